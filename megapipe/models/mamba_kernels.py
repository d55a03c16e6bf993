"""Which code runs a Mamba-2 mixer's sequence mixing: the fused CUDA kernels of ``mamba-ssm`` (the chunked SSD scan
``mamba_chunk_scan_combined``, the decode step ``selective_state_update``) and ``causal-conv1d`` (``causal_conv1d_fn``,
``causal_conv1d_update``) where both import and the tensors are on CUDA (the ``mamba`` extra, GPU-only), else the
PyTorch path of megapipe.models.ssd, which gives the same results up to round-off.

``path_for(t)`` returns one of the two; both answer the same four calls, with the conv's SiLU included:
  ``conv(x, weight, bias, state, document_ids) -> (silu(conv(x)) [B, S, C], new conv state [B, C, K-1])``;
  ``conv_step(x, weight, bias, state, inplace) -> (silu(conv) [B, C], new state)``;
  ``scan(x, dt, A, B, C, chunk_size, D, initial_state, document_ids) -> (y, final state)`` (ssd.ssd_chunked's);
  ``step(state, x, dt, A, B, C, D, inplace) -> (y, new state)`` (ssd.ssd_step's).
dt reaches the kernels after its bias, softplus and limits (megapipe applies them), so they get no dt_bias and no
softplus of their own. The few cases the kernels do not take (an incoming state together with packed documents)
go through the PyTorch path; ``MEGAPIPE_MAMBA_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from megapipe.models import ssd


class TorchPath:
    """megapipe.models.ssd's PyTorch code: every device."""

    name = "torch"

    @staticmethod
    def conv(x, weight, bias, state=None, document_ids=None):
        y, new_state = ssd.causal_conv1d(x, weight, bias, state, document_ids)
        return F.silu(y), new_state

    @staticmethod
    def conv_step(x, weight, bias, state, inplace=False):
        y, new_state = ssd.conv_step(x, weight, bias, state, inplace)
        return F.silu(y), new_state

    scan = staticmethod(ssd.ssd_chunked)
    step = staticmethod(ssd.ssd_step)


class FusedPath:
    """The CUDA kernels in ``kernels`` (their four functions by their published names)."""

    name = "fused"

    def __init__(self, kernels: SimpleNamespace):
        self.k = kernels

    def conv(self, x, weight, bias, state=None, document_ids=None):
        if state is not None and document_ids is not None:
            return TorchPath.conv(x, weight, bias, state, document_ids)
        # the kernel reads [B, C, S] channels-last (stride 1 over C): x's own memory, and the state laid out alike
        initial = None if state is None else state.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        seq_idx = None if document_ids is None else ssd.document_runs(document_ids).to(torch.int32)
        y = self.k.causal_conv1d_fn(
            x.transpose(1, 2),
            weight.to(x.dtype),
            None if bias is None else bias.to(x.dtype),
            seq_idx=seq_idx,
            initial_states=initial,
            activation="silu",
        )
        return y.transpose(1, 2), ssd.conv_state_after(x, weight.shape[-1], state, document_ids)

    def conv_step(self, x, weight, bias, state, inplace=False):
        state = state if inplace else state.clone()
        y = self.k.causal_conv1d_update(
            x, state, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), activation="silu"
        )
        return y, state

    def scan(self, x, dt, A, B, C, chunk_size, D=None, initial_state=None, document_ids=None):
        if initial_state is not None and document_ids is not None:
            return TorchPath.scan(x, dt, A, B, C, chunk_size, D, initial_state, document_ids)
        seq_idx = None if document_ids is None else ssd.document_runs(document_ids).to(torch.int32)
        initial = None if initial_state is None else initial_state.float()
        y, state = self.k.mamba_chunk_scan_combined(
            x,
            dt.float(),
            A.float(),
            B,
            C,
            chunk_size,
            D=None if D is None else D.float(),
            initial_states=initial,
            seq_idx=seq_idx,
            return_final_states=True,
        )
        return y.to(x.dtype), state.float()

    def step(self, state, x, dt, A, B, C, D=None, inplace=False):
        # the kernel takes dt, A and D per channel (head x head_dim; A also per state dim): broadcast views
        state = state if inplace else state.float().clone()
        h, p, n = state.shape[1:]
        y = self.k.selective_state_update(
            state,
            x,
            dt.float()[..., None].expand(-1, h, p),
            A.float()[:, None, None].expand(h, p, n),
            B,
            C,
            D=None if D is None else D.float()[:, None].expand(h, p),
            dt_softplus=False,
        )
        return y.to(x.dtype), state


@functools.lru_cache(maxsize=None)
def imported_kernels() -> Optional[SimpleNamespace]:
    """The four kernels, or None where mamba-ssm or causal-conv1d does not import."""
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or built against another torch / CUDA: the PyTorch path serves
        return None
    return SimpleNamespace(
        causal_conv1d_fn=causal_conv1d_fn,
        causal_conv1d_update=causal_conv1d_update,
        mamba_chunk_scan_combined=mamba_chunk_scan_combined,
        selective_state_update=selective_state_update,
    )


def kernels_for(t: torch.Tensor) -> Optional[SimpleNamespace]:
    """The fused kernels for tensors like ``t``: on CUDA where they import and are not switched off, else None."""
    if t.device.type != "cuda" or os.environ.get("MEGAPIPE_MAMBA_KERNELS", "1") == "0":
        return None
    return imported_kernels()


def path_for(t: torch.Tensor):
    """The code that mixes a sequence held in tensors like ``t``: FusedPath on CUDA with the kernels, else TorchPath."""
    kernels = kernels_for(t)
    return TorchPath if kernels is None else FusedPath(kernels)
