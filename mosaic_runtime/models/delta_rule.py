"""The gated delta rule of Gated DeltaNet layers, in two torch forms with one signature: a recurrent step
loop (decode) and a chunked form (prefill on any device); and the native core's (prefill on the CPU:
delta_rule.cpp, the recurrence a block of the state's columns at a time, every key head read in place by
its value heads). All three are float32 and agree to rounding.

Per value head h, with k and q L2-normalised (q also scaled by 1/sqrt(dk)) and g <= 0 a log-decay:
    S = exp(g_t) * S                      decay first
    u = beta_t * (v_t - S^T k_t)          the delta
    S = S + k_t u^T                       write
    o_t = S^T q_t                         read after the write
State S: [Hv, dk, dv]; q, k: [T, Hv, dk]; v: [T, Hv, dv]; g, beta: [T, Hv].
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _native
from ..ops import threads

CHUNK = 64
_ISA = _native.kernels.best_isa()


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """o [T, Hv, dv]; `state` is updated in place."""
    out = torch.empty(v.shape, dtype=torch.float32)
    decay = g.exp()
    for t in range(q.shape[0]):
        state.mul_(decay[t][:, None, None])
        kv = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same, CHUNK tokens at a time (the WY form): within a chunk the deltas U solve
    (I + A) U = beta*V - (beta*exp(G)*K) S0 with A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t and
    G the chunk's cumulative log-decay; outputs and the next state follow from U in matrix products."""
    t_all, heads, dk = k.shape
    out = torch.empty(v.shape, dtype=torch.float32)
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    gh, bh = g.transpose(0, 1), beta.transpose(0, 1)     # [H, T]
    for c0 in range(0, t_all, chunk):
        c1 = min(c0 + chunk, t_all)
        n = c1 - c0
        qc, kc, vc, bc = qh[:, c0:c1], kh[:, c0:c1], vh[:, c0:c1], bh[:, c0:c1]
        cum = gh[:, c0:c1].cumsum(-1)                                    # [H, n]
        diff = cum[:, :, None] - cum[:, None, :]                         # G_t - G_s
        lower = torch.ones(n, n, dtype=torch.bool).tril(-1)              # s < t
        lower_incl = torch.ones(n, n, dtype=torch.bool).tril()           # s <= t
        decay_strict = diff.masked_fill(~lower, float("-inf")).exp()     # zero where s >= t (no overflow)
        decay_incl = diff.masked_fill(~lower_incl, float("-inf")).exp()
        a = bc[:, :, None] * decay_strict * (kc @ kc.transpose(1, 2))    # [H, n, n]
        eye = torch.eye(n).expand(heads, n, n)
        rhs_v = bc[:, :, None] * vc                                      # beta * V
        rhs_k = (bc * cum.exp())[:, :, None] * kc                        # beta * exp(G) * K
        w_v = torch.linalg.solve_triangular(eye + a, rhs_v, upper=False, unitriangular=True)
        w_k = torch.linalg.solve_triangular(eye + a, rhs_k, upper=False, unitriangular=True)
        u = w_v - w_k @ state                                            # [H, n, dv]
        o = (cum.exp()[:, :, None] * qc) @ state + (decay_incl * (qc @ kc.transpose(1, 2))) @ u
        out[c0:c1] = o.transpose(0, 1)
        last = cum[:, -1]                                                # G at the chunk's end
        state.mul_(last.exp()[:, None, None])
        state.add_((kc * (last[:, None] - cum).exp()[:, :, None]).transpose(1, 2) @ u)
    return out


def native_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The same on the CPU in the native core. q, k [T, Hk, dk] per key head (value head h reads key head
    h // (Hv // Hk)); v [T, Hv, dv] with contiguous heads (a view of the conv's output will do)."""
    out = np.empty(v.shape, np.float32)
    _native.kernels.gated_delta_rule(_ISA, threads(), q.contiguous().numpy(), k.contiguous().numpy(), v.numpy(),
                                     g.contiguous().numpy(), beta.contiguous().numpy(), state.numpy(), out)
    return torch.from_numpy(out)
