"""Release properties: supported JAX range, FFI API version, build_info, CUDA-graph declarations.

The wheel itself (build, fresh venv, newest and oldest jax, smoke test of every op) is checked
by tools/check_wheel.py, run from .ci/run; set JAXOPS_TEST_WHEEL=1 to run it from here too.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import sys

import jax
import pytest

import jaxops
from jaxops import _ffi, _version_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADERS = os.path.join(ROOT, "third_party", "xla_ffi")
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


# ------------------------------------------------------------------ the declared JAX range


def test_pyproject_declares_the_supported_range():
    text = _read("pyproject.toml")
    minimum = _version_check.JAX_MINIMUM
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    assert f'"jax>={minimum}"' in deps and f'"jaxlib>={minimum}"' in deps, deps
    build_requires = re.search(r"^requires = \[(.*?)\]", text, re.M | re.S).group(1)
    # the build uses the committed headers, so it must not need (or pin) a jax
    assert "jax" not in build_requires, build_requires


def test_readme_declares_the_supported_range():
    readme = _read("README.md")
    assert re.search(rf"jax\S*\s*(>=|≥|\bor newer\b)?\s*{re.escape(_version_check.JAX_MINIMUM)}", readme), \
        f"README.md must state the supported jax range (jax >= {_version_check.JAX_MINIMUM})"


def test_vendored_headers_are_the_oldest_jaxlibs():
    c_api = _read("third_party", "xla_ffi", "include", "xla", "ffi", "api", "c_api.h")
    major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", c_api).group(1))
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", c_api).group(1))
    assert (major, minor) == _version_check.FFI_API_VERSION
    readme = _read("third_party", "xla_ffi", "README.md")
    assert f"jaxlib {_version_check.JAX_MINIMUM}" in readme
    for name in ("api.h", "c_api.h", "ffi.h"):
        with open(os.path.join(HEADERS, "include", "xla", "ffi", "api", name), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        assert f"{digest}  {name}" in readme, f"{name} differs from the jaxlib copy recorded in README"
    assert "Apache License" in _read("third_party", "xla_ffi", "LICENSE")


def test_installed_jax_is_in_range():
    assert _version_check.parse_version(jax.__version__) >= _version_check.parse_version(
        _version_check.JAX_MINIMUM)


@pytest.mark.parametrize("version,expected", [
    ("0.5.0", (0, 5, 0)), ("0.9.0.1", (0, 9, 0, 1)), ("0.6.0.dev20250101", (0, 6, 0)),
    ("0.11.2", (0, 11, 2)), ("1.0rc1", (1, 0)), ("0.4.38+cuda12", (0, 4, 38)),
])
def test_parse_version(version, expected):
    assert _version_check.parse_version(version) == expected


@pytest.mark.parametrize("jax_v,jaxlib_v", [("0.4.38", "0.4.38"), ("0.5.0", "0.4.36"), ("0.4.30", "0.5.0")])
def test_too_old_jax_is_an_actionable_import_error(jax_v, jaxlib_v):
    with pytest.raises(ImportError) as info:
        _version_check.check_jax(jax_v, jaxlib_v)
    message = str(info.value)
    assert f">= {_version_check.JAX_MINIMUM}" in message and "pip install" in message
    assert (jax_v if jax_v != "0.5.0" else jaxlib_v) in message


@pytest.mark.parametrize("jax_v,jaxlib_v", [("0.5.0", "0.5.0"), ("0.11.2", "0.11.2"), ("1.2.3", "1.2.3")])
def test_supported_jax_passes(jax_v, jaxlib_v):
    _version_check.check_jax(jax_v, jaxlib_v)


def test_refused_registration_is_an_actionable_import_error():
    err = _version_check.registration_error("jaxops_softmax_fwd", "cpu", RuntimeError("API version 0.1"), (0, 1))
    text = str(err)
    assert isinstance(err, ImportError)
    assert "jaxops_softmax_fwd" in text and "0.1" in text and _version_check.JAX_MINIMUM in text
    assert "JAXOPS_FFI_INCLUDE_DIR=jax" in text


def test_import_on_too_old_jax_raises_import_error(tmp_path):
    # A fake jax 0.4.30 ahead of the real one on sys.path: importing jaxops must stop with
    # an ImportError naming the version needed, before anything touches jax.ffi.
    fake = tmp_path / "fake"
    (fake / "jax").mkdir(parents=True)
    (fake / "jax" / "__init__.py").write_text("__version__ = '0.4.30'\n")
    (fake / "jaxlib").mkdir()
    (fake / "jaxlib" / "__init__.py").write_text("")
    (fake / "jaxlib" / "version.py").write_text("__version__ = '0.4.30'\n")
    jaxops_parent = os.path.dirname(os.path.dirname(jaxops.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), jaxops_parent]))
    proc = subprocess.run([sys.executable, "-c", "import jaxops"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "ImportError: jaxops needs jax and jaxlib >= " + _version_check.JAX_MINIMUM in proc.stderr, proc.stderr


# ------------------------------------------------------------------ build_info


def test_build_info():
    info = jaxops.build_info()
    assert info["version"] == jaxops.__version__
    assert info["ffi_api_version"] == _version_check.FFI_API_VERSION
    assert info["jax_version"] == jax.__version__
    assert info["jax_minimum"] == _version_check.JAX_MINIMUM
    assert info["platforms"][0] == "cpu"
    assert ("cuda" in info["platforms"]) == jaxops.has_cuda()
    assert info["targets"]["cpu"] > 0
    if jaxops.has_cuda():
        assert info["cuda_architectures"] and all(re.fullmatch(r"\d+(-real|-virtual)?", a)
                                                  for a in info["cuda_architectures"])
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info["cuda_version"])
        assert info["targets"]["cuda"] > 0
    else:
        assert info["cuda_architectures"] is None and info["cuda_version"] is None


def test_device_plan(monkeypatch):
    # Which chip-dependent plans the CUDA kernels take (session 61): None without the CUDA
    # handlers or without a GPU (CI builds them on a machine with nvcc and no GPU); on a GPU the
    # DRAM rate a cycle of an SM and the plan, which JAXOPS_FAST_DRAM forces either way.
    monkeypatch.delenv("JAXOPS_FAST_DRAM", raising=False)
    plan = _ffi.device_plan()
    if not jaxops.has_cuda() or jax.default_backend() != "gpu":
        assert plan is None
        return
    assert 5.0 < plan["dram_bytes_per_sm_cycle"] < 100.0  # H100 ~12.8, H200 ~18.8
    assert plan["fast_dram"] == (plan["dram_bytes_per_sm_cycle"] > 15.5)
    for forced, want in (("0", False), ("1", True)):
        monkeypatch.setenv("JAXOPS_FAST_DRAM", forced)
        assert _ffi.device_plan()["fast_dram"] is want


# ------------------------------------------------------------------ handler metadata (what XLA sees)
# XLA asks each handler for its metadata (FFI API version and traits) by calling it with a call
# frame that carries the metadata extension; api=NULL, no arguments. We do the same through
# ctypes, so the command-buffer declaration of every CUDA handler is checked without a GPU.
# Layouts: xla/ffi/api/c_api.h (the vendored FFI API 0.1 headers).


class _ExtBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32)]


class _MetadataExt(ctypes.Structure):
    _fields_ = [("extension_base", _ExtBase), ("metadata", ctypes.POINTER(_Metadata))]


class _Args(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("args", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("names", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p)]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _Args), ("rets", _Args), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


def _struct_size(cls):
    """XLA_FFI_DEFINE_STRUCT_TRAITS(cls, last): offset of `last` plus its size (no tail padding).

    `last` is the final field except for XLA_FFI_CallFrame, whose traits end at `attrs`
    (`future` came later and is not counted)."""
    last = "attrs" if cls is _CallFrame else cls._fields_[-1][0]
    ftype = dict(cls._fields_)[last]
    return getattr(cls, last).offset + ctypes.sizeof(ftype)


_XLA_FFI_EXTENSION_METADATA = 1
_CMD_BUFFER_COMPATIBLE = 1


def handler_metadata(capsule):
    """(api major, api minor, traits) that the FFI handler in ``capsule`` reports to XLA."""
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    pointer = get(capsule, get_name(capsule))  # nanobind names its capsules
    assert pointer, "not a function capsule"
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))(pointer)
    metadata = _Metadata(struct_size=_struct_size(_Metadata),
                         api_version=_ApiVersion(struct_size=_struct_size(_ApiVersion)))
    ext = _MetadataExt(extension_base=_ExtBase(_struct_size(_MetadataExt), _XLA_FFI_EXTENSION_METADATA, None),
                       metadata=ctypes.pointer(metadata))
    frame = _CallFrame(struct_size=_struct_size(_CallFrame), extension_start=ctypes.addressof(ext),
                       stage=3, args=_Args(struct_size=_struct_size(_Args)),
                       rets=_Args(struct_size=_struct_size(_Args)), attrs=_Attrs(struct_size=_struct_size(_Attrs)))
    error = handler(ctypes.byref(frame))
    assert not error, "the handler returned an error for the metadata query"
    return metadata.api_version.major_version, metadata.api_version.minor_version, metadata.traits


def _libraries():
    libs = [("cpu", _ffi._jaxops_cpu)]
    if _ffi._jaxops_cuda is not None:
        libs.append(("cuda", _ffi._jaxops_cuda))
    return libs


def test_frame_layout_matches_the_headers():
    # XLA_FFI_CallFrame_STRUCT_SIZE etc. of the 0.1 headers on LP64; a mismatch would make the
    # handlers below reject the frame.
    assert _struct_size(_CallFrame) == 168 and _struct_size(_Metadata) == 36


@pytest.mark.skipif(jaxops.build_info()["ffi_api_version"] != (0, 1),
                    reason="probe layouts are those of the FFI 0.1 headers (built with other headers)")
@pytest.mark.parametrize("platform,lib", _libraries(), ids=[p for p, _ in _libraries()])
def test_every_handler_reports_the_oldest_ffi_api(platform, lib):
    targets = lib.registrations()
    assert targets, f"no {platform} targets registered"
    for name, capsule in targets.items():
        major, minor, traits = handler_metadata(capsule)
        assert (major, minor) == _version_check.FFI_API_VERSION, (name, major, minor)
        if platform == "cuda":
            assert traits & _CMD_BUFFER_COMPATIBLE, \
                f"CUDA handler {name} is not declared {{ffi::Traits::kCmdBufferCompatible}}"


def test_cpu_and_cuda_register_the_same_targets():
    if _ffi._jaxops_cuda is None:
        pytest.skip("built without the CUDA handlers")
    assert set(_ffi._jaxops_cpu.registrations()) == set(_ffi._jaxops_cuda.registrations())


def test_cuda_sources_are_graph_safe():
    import audit_cuda_graph_safety

    assert audit_cuda_graph_safety.audit(ROOT) == []


def test_audit_catches_offenders(tmp_path):
    import audit_cuda_graph_safety

    (tmp_path / "cc" / "bad").mkdir(parents=True)
    (tmp_path / "cc" / "bad" / "bad_cuda.cc").write_text(
        "// cudaMalloc( in a comment is fine\n"
        "void f() { cudaMalloc(&p, 4); cudaStreamSynchronize(s); }\n"
        "XLA_FFI_DEFINE_HANDLER_SYMBOL(BadCuda, Impl, ffi::Ffi::Bind().Ctx<X>().Arg<Y>());\n"
        "XLA_FFI_DEFINE_HANDLER_SYMBOL(GoodCuda, Impl, ffi::Ffi::Bind().Arg<Y>(),\n"
        "                              {ffi::Traits::kCmdBufferCompatible});\n")
    problems = audit_cuda_graph_safety.audit(str(tmp_path))
    assert len(problems) == 3, problems
    assert any("cudaMalloc" in p and ":2:" in p for p in problems)
    assert any("BadCuda" in p for p in problems) and not any("GoodCuda" in p for p in problems)


# ------------------------------------------------------------------ recipes and the wheel


def test_every_public_op_has_a_smoke_recipe():
    import op_recipes

    missing = [op for op in op_recipes.public_ops(jaxops) if op not in op_recipes.RECIPES]
    assert not missing, f"add recipes for {missing} to tools/op_recipes.py"


@pytest.mark.skipif(os.environ.get("JAXOPS_TEST_WHEEL") != "1",
                    reason="slow (builds a wheel, downloads jax): set JAXOPS_TEST_WHEEL=1; .ci/run runs it")
def test_wheel_in_fresh_venvs():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_wheel.py"), "--build"])
    assert proc.returncode == 0
