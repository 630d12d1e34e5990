"""The parity check can fail: a data-axis gradient reduction scaled by 2 (as if done twice) is
caught, on representative cases of the ZeRO and composition matrices, by the gradients and their
norms, while the losses and final parameters alone would have passed (AdamW and global-norm
clipping are invariant to the gradient's scale: why `assert_parity` compares gradients at all)."""

import jax
import numpy as np
import pytest

import test_composition
import test_zero
from helpers import GRAD_ATOL, GRAD_NORM_RTOL, assert_parity, parity_failures, run_steps


def _over_data(axis_name) -> bool:
    return "data" in ((axis_name,) if isinstance(axis_name, str) else tuple(axis_name))


def double_data_reduction(monkeypatch, seam: str) -> None:
    """Scale the data-axis gradient reduction of the code under test by 2, at one of its two seams
    (jax.lax functions as jaxpar's modules call them, so no hook in jaxpar itself):

    - "collective": the explicit reductions, `jax.lax.psum` / `psum_scatter` over an axis set
      holding `data`, of non-scalar operands (gradients; the loss, a scalar, is left alone);
    - "cast": a parameter's cast to data-varying (`jax.lax.pcast(..., to="varying")`), whose
      transpose is the all-reduce of its gradient (ZeRO-0/1's per-layer reduction): the cast's
      value is unchanged and its cotangent doubled, so the reduction sums twice the gradient.
    """
    if seam == "collective":
        for name in ("psum", "psum_scatter"):
            original = getattr(jax.lax, name)

            def doubled(x, axis_name, *args, _original=original, **kwargs):
                out = _original(x, axis_name, *args, **kwargs)
                if not _over_data(axis_name):
                    return out
                return jax.tree.map(lambda y: y * 2 if y.ndim else y, out)

            monkeypatch.setattr(jax.lax, name, doubled)
    else:
        assert seam == "cast", seam
        original = jax.lax.pcast

        def doubled_cotangent(x, axis_name, *, to):
            out = original(x, axis_name, to=to)
            if to != "varying" or not _over_data(axis_name):
                return out
            return jax.tree.map(lambda y: y + (y - jax.lax.stop_gradient(y)), out)  # value y, cotangent x 2

        monkeypatch.setattr(jax.lax, "pcast", doubled_cotangent)


# (name, config, reference, seam of its gradient reduction)
CASES = {
    # ZeRO-0, one microbatch: all-reduced per layer inside the backward layer scan.
    "zero0-per-layer": (lambda: test_zero.tiny_zero("gpt2", 0, 8, 1), lambda: test_zero.reference("gpt2"), "cast"),
    # ZeRO-2 with accumulation: reduce-scattered (and the replicated leaves all-reduced) after the loop.
    "zero2-after-the-loop": (lambda: test_zero.tiny_zero("gpt2", 2, 8, 4), lambda: test_zero.reference("gpt2"),
                             "collective"),
    # Pipelined (2, 4, 1) GPipe with ZeRO-2: reduced once after the tick loop.
    "pipeline-zero2": (lambda: test_composition.composed(2, 4, 1, "gpipe", 2, None, "llama"),
                       lambda: test_composition.reference(test_composition.composed(2, 4, 1, "gpipe", 2, None, "llama")),
                       "collective"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_doubled_reduction_fails_parity_through_the_gradients(case, monkeypatch):
    make_cfg, make_ref, seam = CASES[case]
    ref = make_ref()  # before the mutation (one device: no data axis to mutate anyway)
    cfg = make_cfg()
    assert_parity(run_steps(cfg), ref)  # the case passes unmutated
    double_data_reduction(monkeypatch, seam)
    out = run_steps(cfg)
    monkeypatch.undo()
    # The mutation did what it says: at the initial parameters every gradient, and so their norm,
    # exactly doubled. (If this fails, the case's reduction no longer goes through `seam`: move the
    # hook.) Later steps start from parameters that moved slightly differently.
    np.testing.assert_allclose(out["grad_norms"][0], 2 * ref["grad_norms"][0], rtol=GRAD_NORM_RTOL)
    for g, want in zip(jax.tree.leaves(out["grads"]), jax.tree.leaves(ref["grads"]), strict=True):
        assert np.max(np.abs(g - 2 * want)) < 2 * GRAD_ATOL
    failed = parity_failures(out, ref)
    assert {"grads", "grad_norms"} <= set(failed), failed
    # And the point of comparing them: the losses and parameters alone would have passed. These
    # cases clip at every step (the reference's gradient norm exceeds grad_clip), so a doubled
    # gradient is clipped to the same one; where the reference's norm is below grad_clip (the llama
    # config of test_zero.py: 0.93), doubling switches clipping on and the parameters drift by
    # ~4e-4 after 3 steps, which PARAM_ATOL would see: the gradients are the check that always does.
    assert min(ref["grad_norms"]) > cfg.train.grad_clip, ref["grad_norms"]
    assert "losses" not in failed and "params" not in failed, failed
    with pytest.raises(AssertionError, match="parity fails on grad_norms.*grads"):
        assert_parity(out, ref)
