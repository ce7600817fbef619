"""The ncu source-page reader: stall samples summed per reason, instructions ranked by samples,
the mix by opcode (a predicate guard dropped), several kernels kept apart, .xz read, bad input named."""

import lzma

import pytest

from kvledger.bench import ncu_stalls

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"\n'
)


def _report() -> str:
    rows = [
        '"Kernel Name","fp8_kernel",\n',
        HEADER,
        '"0x7f00","      BAR.SYNC.DEFER_BLOCKING 0x0","90","88","1,000","0","88","2","70"\n',
        '"0x7f10","      @!P0 LDS.U8 R1, [R2]","10","9","2,000","6","0","4","0"\n',
        '"0x7f20","      LDS.U8 R3, [R4]","5","5","2,000","0","0","5","0"\n',
        '"Kernel Name","bf16_kernel",\n',
        HEADER,
        '"0x8f00","      HMMA.16816.F32.BF16 R0, R4, R8, R0","7","7","640","0","1","6","1"\n',
    ]
    return "".join(rows)


def test_parse_sums_reasons_ranks_instructions_and_keeps_kernels_apart():
    fp8, bf16 = ncu_stalls.parse(_report())
    assert (fp8.name, bf16.name) == ("fp8_kernel", "bf16_kernel")
    assert fp8.samples == 105 and fp8.executed == 5000
    # "Not Issued" columns are a subset of the samples, not extra reasons
    assert fp8.reasons() == {"barrier": 6, "long_sb": 88, "wait": 11}
    assert fp8.mix() == {"BAR.SYNC.DEFER_BLOCKING": 1000, "LDS.U8": 4000}
    assert bf16.reasons() == {"barrier": 0, "long_sb": 1, "wait": 6}
    text = "\n".join(fp8.lines(top=1))
    assert "BAR.SYNC.DEFER_BLOCKING 0x0" in text and "long_sb 88" in text
    assert "LDS.U8" in text.split("instruction mix")[1]  # the mix names it, the top-1 list does not
    assert "LDS.U8 R1" not in text


def test_cli_reads_xz_and_names_bad_input(tmp_path, capsys):
    report = tmp_path / "r.csv.xz"
    report.write_bytes(lzma.compress(_report().encode()))
    assert ncu_stalls.main([str(report), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("kernel ") == 2 and "88.0%" not in out and "83.8%" in out  # long_sb 88 of 105 samples
    bad = tmp_path / "other.csv"
    bad.write_text('"Kernel Name","k",\n"Address","Source"\n"0x1","NOP"\n')
    assert ncu_stalls.main([str(bad)]) == 2
    assert "Warp Stall Sampling" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no kernel"):
        ncu_stalls.parse("a,b\n1,2\n")
