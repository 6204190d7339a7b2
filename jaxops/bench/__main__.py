from jaxops.bench.cli import main

raise SystemExit(main())
