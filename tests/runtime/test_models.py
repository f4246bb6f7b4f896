import pytest
import torch

from rlhfc.runtime.models.build import (
    PolicyModel,
    ScoreModel,
    ValueModel,
    build_model,
    copy_weights,
    get_weights,
    last_token_index,
    load_weights,
    normalize_spec,
    position_ids_from_mask,
    save_weights,
    set_weights,
)


def _same_weights(a, b):
    wa, wb = get_weights(a), get_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("head,cls", [("lm", PolicyModel), ("value", ValueModel), ("score", ScoreModel)])
def test_build_is_deterministic_and_leaves_global_rng_alone(arch, make_spec, head, cls):
    spec = make_spec(arch, head=head)
    before = torch.random.get_rng_state()
    a, b, c = build_model(spec, 7), build_model(spec, 7), build_model(spec, 8)
    assert torch.equal(before, torch.random.get_rng_state())
    assert isinstance(a, cls) and not a.training
    assert _same_weights(a, b)
    assert not _same_weights(a, c)


def test_output_shapes(policy, value_model, score_model):
    ids = torch.randint(3, 96, (3, 7))
    mask = torch.ones_like(ids)
    assert policy.forward_logits(ids, mask).shape == (3, 7, 96)
    assert value_model.values(ids, mask).shape == (3, 7)
    assert score_model.score(ids, mask).shape == (3,)


def test_left_padding_matches_unpadded(policy, value_model, score_model):
    torch.manual_seed(0)
    rows = [torch.randint(3, 96, (n,)) for n in (5, 2, 8)]
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :] = r
        mask[i, t - len(r) :] = 1
    with torch.no_grad():
        logits = policy.forward_logits(ids, mask)
        values = value_model.values(ids, mask)
        scores = score_model.score(ids, mask)
        for i, r in enumerate(rows):
            one = torch.ones(1, len(r), dtype=torch.long)
            torch.testing.assert_close(logits[i, t - len(r) :], policy.forward_logits(r[None], one)[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values[i, t - len(r) :], value_model.values(r[None], one)[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(scores[i], score_model.score(r[None], one)[0], atol=1e-5, rtol=1e-5)


def test_score_reads_last_real_token_with_right_padding(score_model):
    ids = torch.tensor([[0, 0, 5, 6, 7, 0, 0], [4, 5, 6, 7, 8, 9, 10]])
    mask = (ids != 0).long()
    with torch.no_grad():
        per_token = score_model.token_outputs(ids, mask)
        torch.testing.assert_close(score_model.score(ids, mask), torch.stack([per_token[0, 4], per_token[1, 6]]))


def test_mask_helpers():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    assert position_ids_from_mask(mask).tolist()[0] == [0, 0, 0, 1, 2, 2]
    assert position_ids_from_mask(mask).tolist()[1] == [0, 1, 2, 3, 4, 5]
    assert last_token_index(mask).tolist() == [4, 5, 0]


def test_weights_roundtrip_through_safetensors(tmp_path, arch, make_spec):
    # gpt2 ties lm_head to the embedding: get_weights must still be saveable.
    a, b = build_model(make_spec(arch), 0), build_model(make_spec(arch), 1)
    path = str(tmp_path / "w.safetensors")
    save_weights(a, path)
    load_weights(b, path)
    assert _same_weights(a, b)
    set_weights(b, get_weights(build_model(make_spec(arch), 3)))
    assert not _same_weights(a, b)


def test_copy_weights_between_heads(arch, make_spec):
    actor = build_model(make_spec(arch), 0)
    critic = build_model(make_spec(arch, head="value"), 5)
    head_before = critic.head.weight.detach().clone()
    copy_weights(actor, critic)
    a, c = actor.trunk.state_dict(), critic.trunk.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert torch.equal(critic.head.weight, head_before)
    ref = build_model(make_spec(arch), 9)
    copy_weights(actor, ref)
    assert _same_weights(actor, ref)


def test_copy_weights_rejects_other_shapes(make_spec):
    small = build_model(make_spec("llama"), 0)
    wide = build_model(make_spec("llama", head="value", hidden=64), 0)
    with pytest.raises(ValueError, match="shape"):
        copy_weights(small, wide)


def test_load_from_local_folder(tmp_path, arch, make_spec):
    src = build_model(make_spec(arch), 0)
    src.hf.save_pretrained(tmp_path, safe_serialization=True)
    spec = {"head": "lm", "source": str(tmp_path)}
    loaded = build_model(spec, 0)
    assert _same_weights(src, loaded)
    critic = build_model({"head": "value", "source": str(tmp_path)}, 4)
    s, c = src.trunk.state_dict(), critic.trunk.state_dict()
    assert all(torch.equal(s[k], c[k]) for k in s)
    ids = torch.randint(3, 96, (2, 5))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_logits(ids, mask), src.forward_logits(ids, mask))


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"arch": "mamba", "layers": 1, "hidden": 8, "heads": 2, "vocab": 10}, "arch"),
        ({"arch": "llama", "layers": 1, "hidden": 8, "heads": 3, "vocab": 10}, "divisible"),
        ({"arch": "gpt2", "layers": 1, "hidden": 8, "heads": 2, "kv_heads": 1, "vocab": 10}, "kv_heads"),
        ({"arch": "llama", "layers": 1, "hidden": 8, "heads": 2, "vocab": 10, "head": "q"}, "head"),
        ({"arch": "llama", "hidden": 8, "heads": 2, "vocab": 10}, "layers"),
    ],
)
def test_normalize_spec_rejects_bad_specs(bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_spec(bad)


def test_normalize_spec_defaults():
    spec = normalize_spec({"arch": "llama", "layers": 1, "hidden": 64, "heads": 2, "vocab": 10})
    assert spec["kv_heads"] == 2 and spec["ffn"] == 192 and spec["head"] == "lm" and spec["source"] is None
    assert normalize_spec({**spec, "arch": "gpt2", "ffn": None})["ffn"] == 256


def test_score_head_is_loaded_from_a_sequence_classifier(tmp_path, arch, make_spec):
    from transformers import AutoModelForSequenceClassification

    from rlhfc.runtime.models.build import _hf_config, normalize_spec

    config = _hf_config(normalize_spec(make_spec(arch)))
    config.num_labels = 1
    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_config(config).eval()
    classifier.save_pretrained(tmp_path, safe_serialization=True)
    scorer = build_model({"head": "score", "source": str(tmp_path)}, 0)
    ids = torch.randint(3, 96, (3, 6))
    with torch.no_grad():
        expect = classifier(input_ids=ids).logits.squeeze(-1)
        torch.testing.assert_close(scorer.score(ids, torch.ones_like(ids)), expect, atol=1e-5, rtol=1e-5)


def test_a_classifier_of_several_labels_is_refused_as_a_reward_model(tmp_path, make_spec):
    from transformers import AutoModelForSequenceClassification

    from rlhfc.runtime.models.build import _hf_config, normalize_spec

    config = _hf_config(normalize_spec(make_spec("llama")))
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="scores 2 labels.*num_labels = 1"):
        build_model({"head": "score", "source": str(tmp_path)}, 0)


@pytest.mark.parametrize("head", ["lm", "value", "score"])
def test_parameter_count_matches_the_compilers_model(arch, make_spec, head):
    """The compiler's cost model counts parameters from the spec; the runtime must build those shapes."""
    arch_mod = pytest.importorskip("rlhfc.ir.arch")
    from rlhfc.runtime.models.build import count_parameters

    spec = normalize_spec(make_spec(arch, head=head))
    fields = [spec[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq")]
    assert count_parameters(build_model(spec, 0)) == arch_mod.param_count(arch, *fields, head=head)
