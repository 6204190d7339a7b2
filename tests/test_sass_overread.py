"""tools/sass_overread.py on hand-written SASS: the widened load session 57 found, and lookalikes."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sass_overread  # noqa: E402


def _sass(*instructions):
    return [f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(instructions)]


def test_flags_a_load_widened_over_a_neighbours_word():
    # Session 57's backward_block_skew: columns R28+4 .. R28+16 read as one 16-byte load from R28.
    lines = _sass("LDS.128 R24, [R28]", "LDS R32, [R28+0x10]", "FADD R25, R25, R1", "STS [R28+0x4], R25",
                  "STS [R28+0x8], R26", "STS [R28+0xc], R27", "STS [R28+0x10], R32")
    found = sass_overread.widened_loads(lines, 300)
    assert [n for n, _, _ in found] == [1]
    assert found[0][2] == [4, 8, 12, 16]


def test_exact_read_modify_write_is_not_flagged():
    lines = _sass("LDS R24, [R28+0x4]", "LDS.64 R26, [R28+0x8]", "LDS R32, [R28+0x10]", "STS [R28+0x4], R24",
                  "STS.64 [R28+0x8], R26", "STS [R28+0x10], R32")
    assert sass_overread.widened_loads(lines, 300) == []


def test_reused_or_rewritten_base_is_not_flagged():
    # The load overwrites its own address register; a later store through "R12" is another address.
    reused = _sass("LDS.128 R12, [R12]", "STS [R12+0x8], R3")
    # The base is recomputed before the store.
    rewritten = _sass("LDS.128 R20, [R8]", "IADD3 R8, R8, 0x40, RZ", "STS [R8+0x4], R21")
    # Load one slot, store the next one (a reduction's exchange), no byte in common.
    exchange = _sass("LDS.64 R12, [R5+0x100]", "STS.64 [R5+0x108], R12")
    for lines in (reused, rewritten, exchange):
        assert sass_overread.widened_loads(lines, 300) == []
