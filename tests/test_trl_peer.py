"""The TRL PPO peer baseline (benchmarks/trl_peer.py) runs offline on CPU."""

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("trl.experimental.ppo")  # PPO left TRL after 1.12

ROOT = Path(__file__).resolve().parents[1]


def _load_peer():
    spec = importlib.util.spec_from_file_location("trl_peer", ROOT / "benchmarks" / "trl_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TINY = dict(
    layers=1,
    hidden=32,
    heads=2,
    vocab=16,
    max_seq=32,
    batch=4,
    max_new_tokens=8,
    prompt_min_len=2,
    prompt_max_len=6,
    steps=2,
    minibatches=2,
    epochs=1,
    lr=1e-5,
    seed=0,
)


def test_run_trl_ppo_tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything written to the working folder would show up here
    peer = _load_peer()
    import trl.experimental.ppo.ppo_trainer as ppo_mod

    saved = (ppo_mod.batch_generation, ppo_mod.forward, ppo_mod.get_reward, ppo_mod.gc)
    r = peer.run_trl_ppo(**TINY, phases=True)

    for key in ("steps", "samples", "wall_s", "samples_per_s", "mean_response_len", "per_step_s"):
        assert key in r, key
    assert r["steps"] == 2
    assert r["samples"] == 8
    assert len(r["per_step_s"]) == 2
    assert all(t > 0 for t in r["per_step_s"])
    assert r["wall_s"] > 0 and math.isfinite(r["wall_s"])
    assert r["wall_s"] >= sum(r["per_step_s"]) * 0.99
    assert r["samples_per_s"] > 0
    assert r["samples_per_s"] == pytest.approx(8 / r["wall_s"])
    assert 0 <= r["mean_response_len"] <= TINY["max_new_tokens"]
    assert 1 <= r["mean_generated_len"] <= TINY["max_new_tokens"]
    assert r["optimizer_steps"] == 2 * 2 * 1
    assert list(tmp_path.iterdir()) == []
    # the phases of the second update (benchmarks/step_profile.py): each timed, adding up to the update
    ph = r["phases"]
    assert set(ph) == {"step", "generation", "forwards", "training", "gc", "other"}
    assert all(ph[k] > 0 for k in ("generation", "forwards", "training", "gc")) and ph["other"] >= 0
    assert sum(ph[k] for k in ("generation", "forwards", "training", "gc", "other")) == pytest.approx(ph["step"])
    assert ph["step"] == pytest.approx(r["per_step_s"][1], rel=0.05)
    assert (ppo_mod.batch_generation, ppo_mod.forward, ppo_mod.get_reward, ppo_mod.gc) == saved   # put back


def test_tokenizer_and_prompts_offline():
    peer = _load_peer()
    tok = peer.build_tokenizer(16)
    assert len(tok) == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("abc", add_special_tokens=False)["input_ids"] == [3, 4, 5]
    ds = peer.build_prompts(tok, n=20, vocab=16, min_len=4, max_len=12, seed=3)
    lens = [len(x) for x in ds["input_ids"]]
    assert all(5 <= n <= 13 for n in lens)  # <bos> + 4..12 characters
    assert all(x[0] == tok.bos_token_id and min(x[1:]) >= 3 for x in ds["input_ids"])
    again = peer.build_prompts(tok, n=20, vocab=16, min_len=4, max_len=12, seed=3)
    assert again["input_ids"] == ds["input_ids"]


def test_rejects_bad_shapes():
    peer = _load_peer()
    with pytest.raises(ValueError):
        peer.run_trl_ppo(**{**TINY, "batch": 5})  # not a multiple of minibatches
    with pytest.raises(ValueError):
        peer.run_trl_ppo(**{**TINY, "max_seq": 10})  # prompt + response too long


def test_run_trl_grpo_tiny_on_a_shared_folder(tmp_path, monkeypatch):
    """TRL's GRPOTrainer on the equal-work start (a saved policy folder and prompt texts): one generation round
    of batch x n completions per update, trained in `minibatches` optimizer steps; lengths as rlhfc counts them
    (to <eos> included); the phases add up to the update."""
    monkeypatch.chdir(tmp_path)
    peer = _load_peer()
    folder = peer.save_shared_folder(str(tmp_path / "m"), layers=1, hidden=32, heads=2, vocab=16, max_seq=32, seed=0)
    texts = peer.prompt_texts(n=16, vocab=16, min_len=2, max_len=6, seed=0)
    r = peer.run_trl_grpo(folder=folder, texts=texts, batch=2, n=4, max_new_tokens=8, steps=2, minibatches=2,
                          lr=1e-5, seed=0, phases=True)
    assert r["steps"] == 2 and len(r["per_update_s"]) == 2 and r["samples_per_s"] > 0
    assert len(r["first_step_generated_lens"]) == 8 and all(1 <= n <= 8 for n in r["first_step_generated_lens"])
    ph = r["phases"]
    assert all(ph[k] > 0 for k in ("generation", "forwards", "training")) and ph["other"] >= 0
    assert sum(ph[k] for k in ("generation", "forwards", "rewards", "training", "other")) == pytest.approx(ph["step"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
