"""A rollout engine from outside rlhfc (the test of docs/runtime.md, "Adding an engine"): it registers itself
and its runtime class here, and a program selects it with ``run { rollout = toy_sampler }`` once it is
loaded with ``--plugin``. No rlhfc file names it.

It decodes one row at a time without a KV cache — every step runs the whole sequence through the model — and
samples each token from the row's own generator (seeded by its row key) at the call's temperature; top_p is
not applied (the traits say so: it runs only ``top_p = 1``). Slow and simple, but a real sampler: tokens,
optional log-probs, per-row budgets, carried rows and ``stop_after`` as the interface asks."""

from __future__ import annotations

import torch

from rlhfc.contract.engines import RolloutTraits, register_rollout
from rlhfc.runtime.rollout.base import RolloutEngine
from rlhfc.runtime.rollout.decoding import FinishedSample, PartialSample


class ToySampler(RolloutEngine):
    def stream(self, model, rows, max_new_tokens, *, refit_mb=64, eos_id, pad_id, temperature=1.0, top_p=1.0,
               budgets=None, stop_after=None, logprob_temperature=None, resumed=None, row_keys=None, slots=None,
               **unused):
        if top_p < 1.0:
            raise ValueError("the toy sampler samples without a nucleus cut (top_p = 1 only)")
        device = next(model.parameters()).device
        keys = list(row_keys) if row_keys is not None else list(range(len(rows)))
        done = 0
        self.worker.engine_stats["toy_rows"] = float(len(rows))   # reported with the rollout (its metrics)
        with torch.no_grad():
            for i, row in enumerate(rows):
                if stop_after is not None and done >= stop_after:
                    yield PartialSample(i, tuple(row), ())   # never started: carried with no tokens
                    continue
                gen = torch.Generator().manual_seed(int(keys[i]))
                ids, out, logps = list(row), [], []
                for _ in range(budgets[i] if budgets is not None else max_new_tokens):
                    x = torch.tensor([ids], device=device)
                    logits = model.forward_logits(x, torch.ones_like(x))[0, -1].float().cpu()
                    probs = torch.softmax(logits / max(temperature, 1e-6), -1)
                    token = int(torch.multinomial(probs, 1, generator=gen))
                    if logprob_temperature is not None:
                        logps.append(float(torch.log_softmax(logits / logprob_temperature, -1)[token]))
                    ids.append(token)
                    out.append(token)
                    if token == eos_id:
                        break
                done += 1
                yield FinishedSample(i, tuple(row), tuple(out), out[-1:] == [eos_id], len(out) - 1, tuple(logps),
                                     float(len(row) * len(out)))


register_rollout(RolloutTraits("toy_sampler", f"{__name__}:ToySampler", title="the toy sampler", top_p_zero=False))
