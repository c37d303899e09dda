"""`deltastate demo --hf` (scripts/demo.sh --hf, python -m deltastate.integrations.demo)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers not installed: demo --hf test SKIPPED "
                    "(pip install transformers==5.23.0)")

from deltastate.integrations import demo  # noqa: E402


@pytest.mark.parametrize("model", ["qwen3-next", "kimi_linear"])
def test_demo_agrees_and_reports(capsys, model):
    rc = demo.main(["--model", model, "--layers", "2", "--batch", "2", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no download), device cpu" in out
    assert "batch 2, prompt lengths [8, 19], greedy, 8 new tokens, cache on" in out
    assert "[##############################]    8/8" in out  # the finished progress bar
    assert "tokens/s" in out and out.count("16 tokens in") == 2
    assert "tokens agree with transformers' torch path: yes (16/16)" in out


def test_demo_no_compare(capsys):
    assert demo.main(["--layers", "2", "--batch", "1", "--new-tokens", "4", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "torch path" not in out and "4 tokens in" in out


def test_demo_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--model", "llama"])
    assert "invalid choice: 'llama'" in capsys.readouterr().err
