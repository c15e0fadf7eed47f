"""The output layer and the language-model loss a chunk of tokens at a time.

Megatron-Core's GPTModel computes the logits of the whole microbatch (``[s, b, V/TP]``), and
its ``vocab_parallel_cross_entropy`` keeps an fp32 copy of them for the backward pass: at
Qwen2.5's 152k vocabulary, seq 4096, mbs 1, TP 1 that is 2.3 GiB of fp32 plus the 16-bit
logits, on a 7B slice more than a layer's activations. :class:`ChunkedCrossEntropy` computes
the same per-token losses a chunk of tokens at a time and keeps only each token's log-sum-exp
(4 bytes) for the backward pass, which recomputes a chunk's logits (one more ``h × V/TP`` GEMM
per token: ~2 % of a 7B step) and turns them into the hidden states' and the output weight's
gradients right away.

Megatron's vocabulary-parallel semantics are kept: each TP rank holds ``V'/TP`` rows of the
output weight (V' the padded vocabulary, whose padding rows never enter the softmax, as
:func:`ray_ppu.model.gpt.mask_padded_vocab` makes the logits path do), the max, the sum of
exponentials and the target's logit are reduced over TP, and the hidden states enter through
Megatron's own mappings (all-gathered along the sequence under SP, else copied), whose
backward sums the ranks' partial input gradients.

:class:`ChunkedLossGPTModel` is GPTModel with its post-processing taking this path when it is
given labels in training or evaluation, through its output layer (:class:`ChunkedOutputLayer`,
so the hooks Megatron DDP puts on that module run); logits (generation) and multi-token
prediction stay Megatron-Core's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from ray_ppu.plan.kernels import chunk_tokens

class _Shard:
    """This rank's share of the vocabulary: rows [start, start + rows) of V', the first
    ``real`` of them real tokens (the rest padding); ``group`` the TP group (None: TP 1)."""

    def __init__(self, start: int, rows: int, vocab_size: int, group) -> None:
        self.start, self.rows, self.group = start, rows, group
        self.real = max(0, min(rows, vocab_size - start))

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits of a chunk over this shard, padding rows at -inf."""
        logits = (hidden @ weight.t()).float()
        if self.real < self.rows:
            logits[:, self.real:] = float("-inf")
        return logits

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def targets(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(column of each label in this shard, clamped; whether it is in this shard)."""
        local = labels - self.start
        inside = (local >= 0) & (local < self.rows)
        return local.clamp(0, self.rows - 1), inside


def _gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the loss's GEMMs take it: as it is, but fp16 on the CPU goes as fp32 (the CPU
    has no fast fp16 GEMM: 1.3 s for one of the demo's output-layer GEMMs, 12 ms in fp32)."""
    return t.float() if t.device.type == "cpu" and t.dtype == torch.float16 else t


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token ``-log softmax(h·Wᵀ)[label]`` over the TP-split vocabulary, a chunk of rows of
    ``hidden [n, h]`` at a time; ``weight [V'/TP, h]``, ``labels [n]``; ``[n]`` fp32 out.

    A microbatch that fits in one chunk keeps its ``softmax − one-hot`` from the forward pass
    (no more than the chunk budget) instead of recomputing the logits: small models with a
    big vocabulary (the demo) pay no extra GEMM."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, shard: _Shard, chunk: int):
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(losses)
        kept = None
        operand = _gemm_operand(weight)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            # in place over one chunk's fp32 logits: shifted by the row max, exponentiated
            logits = shard.logits(_gemm_operand(hidden[rows]), operand)
            peak = shard.all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
            shifted = logits.sub_(peak[:, None])
            column, inside = shard.targets(labels[rows])
            picked = shard.all_reduce(
                shifted.gather(1, column[:, None])[:, 0].masked_fill(~inside, 0.0))
            exp = shifted.exp_()
            sum_exp = shard.all_reduce(exp.sum(dim=-1))
            losses[rows] = torch.log(sum_exp) - picked
            lse[rows] = peak + torch.log(sum_exp)
            if n <= chunk and any(ctx.needs_input_grad[:2]):  # the one chunk: kept for the
                kept = _minus_one_hot(exp.div_(sum_exp[:, None]), column, inside)  # backward
        ctx.save_for_backward(hidden, weight, labels, lse, *([] if kept is None else [kept]))
        ctx.shard, ctx.chunk = shard, chunk
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, labels, lse, *kept = ctx.saved_tensors
        shard, chunk = ctx.shard, ctx.chunk
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        n = hidden.shape[0]
        operand = _gemm_operand(weight)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None
        if want_weight and n > chunk:  # summed over the chunks in fp32, rounded once at the end
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            h = _gemm_operand(hidden[rows])
            if kept:
                d_logits = kept[0] * grad_losses[rows, None]
            else:  # recomputed, a chunk of fp32 logits at a time
                column, inside = shard.targets(labels[rows])
                probs = shard.logits(h, operand).sub_(lse[rows, None]).exp_()
                d_logits = _minus_one_hot(probs, column, inside).mul_(grad_losses[rows, None])
            d_logits = d_logits.to(operand.dtype)
            if want_hidden:  # this shard's part; Megatron's mapping sums the TP ranks' parts
                grad_hidden[rows] = d_logits @ operand
            if want_weight and grad_weight is None:
                grad_weight = d_logits.t() @ h  # the one chunk
            elif want_weight:
                grad_weight.add_(d_logits.t() @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _minus_one_hot(probs: torch.Tensor, column: torch.Tensor,
                   inside: torch.Tensor) -> torch.Tensor:
    """``probs − one-hot(label)`` in place over this shard's columns (no host
    synchronisation: the one-hot is a scatter of 0 / −1)."""
    return probs.scatter_add_(1, column[:, None], -inside.to(probs.dtype)[:, None])


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 vocab_size: int, sequence_parallel: bool, tp_group,
                 chunk: int = 0) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of the output layer ``weight [V'/TP, h]`` on the decoder's
    final hidden states ``hidden [s(/TP under SP), b, h]`` against ``labels [b, s]``:
    Megatron's ``compute_language_model_loss(labels, output_layer(hidden))``, chunked."""
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp > 1:  # the output layer's input mappings (ColumnParallelLinear's)
        if sequence_parallel:
            hidden = mappings.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=tp_group)
        else:
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    s, b, h = hidden.shape
    rank = 0 if tp == 1 else dist.get_rank(tp_group)
    rows = weight.shape[0]
    shard = _Shard(rank * rows, rows, vocab_size, tp_group if tp > 1 else None)
    flat_labels = labels.transpose(0, 1).reshape(-1)  # [s·b], hidden's token order
    with torch.profiler.record_function("ray_ppu.loss"):
        losses = ChunkedCrossEntropy.apply(hidden.reshape(s * b, h), weight, flat_labels,
                                           shard, chunk_tokens(rows, chunk))
    return losses.view(s, b).transpose(0, 1).contiguous()


class ChunkedOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer, which given ``labels`` returns the per-token losses of
    :func:`chunked_loss` instead of logits (``(losses [b, s], None)``), and otherwise the logits
    as ever. The call goes through the module, so every hook on it runs as for the logits
    (Megatron DDP's parameter-gather pre-hook among them)."""

    real_vocab_size: int
    loss_chunk: int = 0

    def forward(self, input_, weight=None, runtime_gather_output=None, labels=None):
        if labels is None:
            return super().forward(input_, weight=weight,
                                   runtime_gather_output=runtime_gather_output)
        weight = self.weight if weight is None else weight
        return chunked_loss(input_, weight, labels, self.real_vocab_size, self.sequence_parallel,
                            self.tp_group, self.loss_chunk), None


class ChunkedLossGPTModel(GPTModel):
    """GPTModel whose loss (labels given, no multi-token prediction) is :func:`chunked_loss`,
    computed by its output layer (:class:`ChunkedOutputLayer`).

    ``real_vocab_size``: the real vocabulary (``vocab_size``, the output layer's, is padded);
    ``chunk``: ``training.cross_entropy_chunk_tokens`` (0 = by
    :data:`ray_ppu.plan.kernels.CHUNK_LOGIT_BYTES`)."""

    def __init__(self, *args, real_vocab_size: int, chunk: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.post_process:
            # GPTModel builds a ColumnParallelLinear; it becomes the subclass that also computes
            # the loss (same parameters, initialisation and checkpoint keys: nothing is rebuilt)
            self.output_layer.__class__ = ChunkedOutputLayer
            self.output_layer.real_vocab_size = real_vocab_size
            self.output_layer.loss_chunk = chunk

    def _postprocess(self, hidden_states, labels=None, mtp_in_postprocess=None,
                     inference_context=None, **kwargs):
        if (labels is None or not self.post_process or mtp_in_postprocess
                or self.config.mtp_num_layers or inference_context is not None):
            return super()._postprocess(hidden_states=hidden_states, labels=labels,
                                        mtp_in_postprocess=mtp_in_postprocess,
                                        inference_context=inference_context, **kwargs)
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else None)
        losses, _ = self.output_layer(hidden_states, weight=weight, labels=labels)
        return losses
