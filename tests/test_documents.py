"""Document masking (`data.document_mask`): a packed sequence's logits are each document's own, and
the masked step computes the same function on every mesh as on one device (loss each step and
gradients: tests/helpers.py's assert_parity)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_parity, run_reference, run_steps
from jaxpar import model
from jaxpar.model.layers import document_positions, document_segments, packed


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_logits_are_each_documents_own(tiny, arch):
    """Row 0 packs three documents (EOS at 5 and 17: each ends its document), row 1 two (EOS at 30);
    the packed logits of every document equal that document run alone, from position 0 (RoPE for
    llama, learned positions for gpt2, restarted at every document start). Without the segments
    they do not (the test sees the mask). Tolerance: the same float32 function, summed in another
    order (the tiled kernel's online softmax)."""
    cfg = tiny(arch, model={"seq_len": 32, "dtype": "float32"}).model
    params = model.init_params(cfg, jax.random.key(0))
    eos = cfg.vocab_size - 1
    tokens = np.random.default_rng(0).integers(0, eos, (2, 32))
    tokens[0, [5, 17]] = eos
    tokens[1, 30] = eos
    tokens = jnp.asarray(tokens)
    segments = document_segments(tokens, eos)
    assert segments[0].tolist() == [0] * 6 + [1] * 12 + [2] * 14 and segments[1].tolist() == [0] * 31 + [1]
    assert document_positions(segments)[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    together = model.apply(cfg, params, tokens, layout=packed(segments))
    for row, a, b in ((0, 0, 6), (0, 6, 18), (0, 18, 32), (1, 0, 31), (1, 31, 32)):
        alone = model.apply(cfg, params, tokens[row:row + 1, a:b])[0]
        np.testing.assert_allclose(together[row, a:b], alone, atol=2e-5, rtol=2e-5)
    plain = model.apply(cfg, params, tokens)
    assert float(jnp.abs(plain[0, 6:18] - together[0, 6:18]).max()) > 1e-2


def test_a_chat_token_the_loss_skips_still_ends_its_document():
    """Chat data's context tokens arrive as ~id (`with_mask`): the step reads their ids before it
    looks for EOS, so a masked EOS still ends its conversation."""
    from jaxpar.model.transformer import token_ids

    tokens = jnp.array([[3, 4, ~7, 5, 6]])
    assert document_segments(token_ids(tokens), 7).tolist() == [[0, 0, 0, 1, 1]]


_REFERENCE = {}


def _documents(tiny, **sections):
    base = dict(model={"seq_len": 32}, data={"document_mask": True})
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return tiny("llama", **base)


def _reference(tiny, **model_changes):
    key = tuple(sorted(model_changes.items()))
    if key not in _REFERENCE:
        _REFERENCE[key] = run_reference(_documents(tiny, model=model_changes))
    return _REFERENCE[key]


CASES = {
    "dp8-zero3": dict(mesh={"data": 8}, parallel={"zero": 3, "zero_min_elements": 0}),
    "dp2-tp4-sp-zero1-m2": dict(mesh={"data": 2, "model": 4},
                                parallel={"sequence_parallel": True, "zero": 1, "microbatches": 2,
                                          "zero_min_elements": 0}),
}


@pytest.mark.parametrize("case", CASES)
def test_document_masking_matches_single_device(tiny, case):
    """Packed documents (the synthetic source's, 2-5 a row) train to the single-device losses and
    gradients under ZeRO-3 over 8 data ranks, and under TP 4 with sequence parallelism, ZeRO-1 and
    2 microbatches."""
    assert_parity(run_steps(_documents(tiny, **CASES[case])), _reference(tiny))


@pytest.mark.slow
def test_document_masking_with_experts_matches_single_device(tiny):
    """An MoE model's packed documents, experts over 4 data ranks beside TP 2: the expert all-to-all
    moves each document's tokens like any other."""
    moe = dict(n_experts=4, experts_per_token=2, expert_d_ff=16)
    assert_parity(run_steps(_documents(tiny, model=moe, mesh={"data": 4, "model": 2})), _reference(tiny, **moe))


def test_document_masking_changes_the_step(tiny):
    """The masked step is another function than the unmasked one on the same packed rows (same
    source: the loss of step 0 differs), so the parity above is of the masked function."""
    from jaxpar.train import loss_fn
    from jaxpar.train.data import SyntheticSource

    cfg = _documents(tiny)
    params = model.init_params(cfg.model, jax.random.key(0))
    rows = jnp.asarray(SyntheticSource(64, 32, 0, documents=True).rows(0, range(8)))
    masked, plain = loss_fn(cfg, params, rows, eos=63), loss_fn(cfg, params, rows)
    assert abs(float(masked) - float(plain)) > 1e-4, (masked, plain)


PIPELINE = {
    "dp2-pp2-1f1b-m4": dict(mesh={"data": 2, "stage": 2}, parallel={"schedule": "1f1b", "microbatches": 4}),
    "pp2-tp2-zb_h1-m2": dict(mesh={"data": 2, "stage": 2, "model": 2},
                             parallel={"schedule": "zb_h1", "microbatches": 2, "sequence_parallel": True}),
}


@pytest.mark.parametrize("case", PIPELINE)
def test_document_masking_in_a_pipeline_matches_single_device(tiny, case):
    """Every F embeds and attends its microbatch's documents on their own (B and W reuse what F
    saved): 1F1B over 2 stages beside 2 data ranks, and ZB-H1 (its split backward) beside TP 2
    with sequence parallelism."""
    assert_parity(run_steps(_documents(tiny, model={"n_layers": 4}, **PIPELINE[case])),
                  _reference(tiny, n_layers=4))
