"""`kvledger show`: page ownership over time as a PNG."""

from kvledger.checker.show import CACHED, FIRST_UID, FREE, LOCKED, main_show, ownership_matrix, render
from kvledger.cli import main
from kvledger.engine.ledger.trace import Header, write
from tests.support.paths import REGRESSIONS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SAME_PREFIX = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 4},
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 6], "max_tokens": 4},
    {"op": "prefill", "budget": 100, "sample": [7]},
    {"op": "decode", "sample": [7]},
]
HEADER = Header(num_pages=16, page_size=2, cache_type="radix", table_slots=4, max_seq_len=32)


def test_ownership_matrix_tracks_free_owned_and_cached_pages():
    matrix, uid_code, divergence, steps = ownership_matrix(HEADER, SAME_PREFIX)
    assert divergence is None and steps == 4 and matrix.shape == (5, 16)
    assert (matrix[0] == FREE).all()
    after_prefill = matrix[3]
    # the shared 4-token prefix is cached and locked (2 pages); each request owns its tail page
    assert (after_prefill == LOCKED).sum() == 2
    assert sorted(uid_code) == [0, 1] and all(code >= FIRST_UID for code in uid_code.values())
    assert {int(c) for c in after_prefill} >= {uid_code[0], uid_code[1]}
    assert CACHED not in after_prefill


def test_show_writes_a_png_and_marks_the_divergence(tmp_path):
    out = tmp_path / "same.png"
    from kvledger.subjects.fast_zoo import patched

    with patched("no-remap-on-duplicate"):
        divergence = render(HEADER, SAME_PREFIX, out)
    assert divergence is not None and divergence.step == 3
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_show_cli_on_the_regression_corpus(tmp_path, capsys):
    for path in sorted(REGRESSIONS.glob("*.jsonl")):
        out = tmp_path / f"{path.stem}.png"
        assert main(["show", str(path), "-o", str(out)]) == 0
        assert out.read_bytes().startswith(PNG_MAGIC)
    assert "no divergence" in capsys.readouterr().out


def test_show_handles_a_thousand_steps(tmp_path):
    header = Header(num_pages=256, page_size=1, cache_type="radix", table_slots=8, max_seq_len=64)
    ops = []
    for uid in range(200):
        ops += [
            {"op": "submit", "uid": uid, "tokens": [uid % 7] * 20, "max_tokens": 6},
            {"op": "prefill", "budget": 64, "sample": [uid % 3]},
        ]
        ops += [{"op": "decode", "sample": [1]}] * 3
    write(tmp_path / "big.jsonl", header, ops)
    out = tmp_path / "big.png"
    assert main_show(str(tmp_path / "big.jsonl"), str(out)) == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 5000


def test_show_reports_bad_traces_clearly(tmp_path, capsys):
    (tmp_path / "broken.jsonl").write_text(
        '{"kvledger_trace": 1, "num_pages": 4, "page_size": 1, '
        '"cache_type": "naive", "table_slots": 1, "max_seq_len": 8}\n{"op": "jump"}\n'
    )
    assert main_show(str(tmp_path / "broken.jsonl"), str(tmp_path / "x.png")) == 2
    assert "unknown op 'jump'" in capsys.readouterr().err
    write(tmp_path / "invalid.jsonl", HEADER, [{"op": "finish", "uid": 9}])
    assert main_show(str(tmp_path / "invalid.jsonl"), str(tmp_path / "x.png")) == 2
    assert "operation 1 is invalid" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
