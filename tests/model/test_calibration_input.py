"""A calibration text that the base's tokenizer turns into 0 tokens: a conversion with calibration stops
with one clear error naming the tokenizer and the ways out (not a reshape error deep in the base's
attention, as a Qwen3 conversion once did), and --no-calibrate converts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hylo.jobs import convert


def _qwen3_base_with_word_level_tokenizer(out: Path) -> Path:
    """A random 2-layer Qwen3 directory whose tokenizer.json is a small word-level vocabulary: transformers
    reads it as a Qwen2Tokenizer that gives no token for the calibration text."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=256)).save_pretrained(out)
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out


def test_a_tokenizer_that_gives_no_calibration_token_is_a_clear_error(tmp_path, capsys):
    from hylo.upcycle import default_calibration_ids

    base = _qwen3_base_with_word_level_tokenizer(tmp_path / "base")
    with pytest.raises(ValueError, match=r"its tokenizer \(Qwen2Tokenizer\): the calibration text gives 0 tokens"):
        default_calibration_ids(base)
    rc = convert.main(["--base", str(base), "--out", str(tmp_path / "out"), "--mla-layers", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and str(base) in line[0] and "--no-calibrate" in line[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert convert.main(["--base", str(base), "--out", str(tmp_path / "out"), "--mla-layers", "0",
                         "--no-calibrate"]) == 0


def test_empty_calibration_ids_given_in_code_are_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo.upcycle import UpcycleError, upcycle

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    with pytest.raises(UpcycleError, match=r"calibration_ids: the calibration text gives 0 tokens"):
        upcycle(base, mla_layers=[0], calibration_ids=torch.zeros(1, 0, dtype=torch.long))
    # one token is enough to run the pass
    upcycle(base, mla_layers=[0], calibration_ids=torch.tensor([[5]]))
