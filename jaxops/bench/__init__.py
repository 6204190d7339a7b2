"""The jaxops benchmark: each op against its pure-JAX/XLA reference and the copy bandwidth."""
