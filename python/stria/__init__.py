# SPDX-License-Identifier: Apache-2.0
"""stria for PyTorch: distributed dynamic sparse (Vertical-Slash) attention as torch operators.

    import stria
    out = stria.sparse_attention(q, k, v)              # q (batch, seq, heads_q, dim), k, v (batch, seq, heads_kv, dim)
    out.sum().backward()                               # dq, dk, dv through stria's sparse backward

The selection is estimated online from q and k (estimator options as keywords) or given
(``selection=stria.Selection(vertical, slash)``). stria.shard / stria.unshard lay a global tensor out
over context-parallel ranks as stria's striped, zigzag and sequential shardings do, and
stria.context_parallel_attention runs stria's ring over the shards held by the processes of a
torch.distributed group. See stria/_ops.py.
"""
from ._ops import PADDING, Selection, context_parallel_attention, estimate_selection, shard, sparse_attention, unshard  # noqa: F401

__version__ = "0.1.0"
__all__ = ["PADDING", "Selection", "context_parallel_attention", "estimate_selection", "shard", "sparse_attention", "unshard"]
