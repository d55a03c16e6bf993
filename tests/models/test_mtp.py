"""Multi-token prediction: the modules on any block kind, the loss against one written out here (shifted labels,
loss masks, packed documents), document isolation, ``mtp_step`` against the full-sequence path, and training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig, validate_mtp
from megapipe.errors import ConfigError, MegapipeError
from megapipe.models import build_model
from megapipe.models.attention import DocumentMask, positions_from_documents
from megapipe.models.capabilities import require
from megapipe.models.dense import TransformerBlock
from megapipe.models.moe import MoEBlock, moe_layers
from megapipe.models.objective import TokenCrossEntropy
from megapipe.models.rope import model_rope
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.step import run_loss, train_step
from megapipe.presets import PRESETS

V = 64
DENSE = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    mtp_num_layers=2, mtp_loss_scaling_factor=0.3)


def moe_cfg(**kw) -> ModelConfig:
    shape = {**PRESETS["deepseek-v3-tiny"], "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 4, "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 16}
    return ModelConfig(vocab_size=V, mtp_num_layers=2, **{**shape, **kw})


def packed_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, 13), generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 4, [7] * 13])
    mask = torch.rand(2, 12, generator=g) > 0.25
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask, "document_ids": docs[:, :-1]}


def written_out(model, batch):
    """The MTP loss of ``batch`` from the modules' parts, labels chosen token by token."""
    tokens, labels, mask, docs = batch["tokens"], batch["labels"], batch["loss_mask"], batch["document_ids"]
    b, s = tokens.shape
    positions = positions_from_documents(docs)
    rope = model_rope(model.cfg, positions, torch.float32)
    doc_mask = DocumentMask(docs, positions)
    h = model(tokens, document_ids=docs, return_hidden=True)
    sums = []
    for depth, m in enumerate(model.mtp, start=1):
        ahead = torch.zeros_like(tokens)
        target = torch.full_like(labels, -100)
        for i in range(b):
            for t in range(s - depth):
                ahead[i, t] = tokens[i, t + depth]
                if docs[i, t + depth] == docs[i, t] and mask[i, t + depth]:
                    target[i, t] = labels[i, t + depth]
        x = m.eh_proj(torch.cat([m.enorm(model.tok_embeddings(ahead)), m.hnorm(h)], dim=-1))
        h = m.block(x, rope, None, doc_mask)
        logits = model.output(m.norm(h))
        sums.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum"))
    return sums


@pytest.mark.parametrize("cfg", [DENSE, moe_cfg()], ids=["dense", "moe"])
@pytest.mark.parametrize("fused", [False, True])
def test_mtp_loss_equals_the_written_out_one(cfg, fused):
    model = build_model(cfg, seed=1)
    batch = packed_batch()
    result = run_loss(model, TokenCrossEntropy(), batch, fused)
    expected = written_out(model, batch)
    for depth, value in enumerate(expected, start=1):
        torch.testing.assert_close(result.metrics[f"mtp/loss_{depth}"], value, rtol=1e-5, atol=1e-5)
    weight = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
    torch.testing.assert_close(result.backprop, weight * sum(expected), rtol=1e-5, atol=1e-5)
    # the reported loss is the LM's alone
    plain = build_model(ModelConfig(**{**cfg.__dict__, "mtp_num_layers": None}), seed=1)
    plain.load_state_dict(model.state_dict(), strict=False)
    torch.testing.assert_close(result.total, run_loss(plain, TokenCrossEntropy(), batch, fused).total)


def test_mtp_modules_take_the_last_layers_block_kind():
    assert all(isinstance(m.block, TransformerBlock) for m in build_model(DENSE, "meta").mtp)
    model = build_model(moe_cfg(), "meta")
    assert all(isinstance(m.block, MoEBlock) for m in model.mtp)
    assert [i for i, _ in moe_layers(model)] == [1, 2, 3]  # its MoE statistics and expert bias count too


def test_packed_documents_do_not_see_each_other():
    """Each document's labelled MTP logits equal those of the document run alone."""
    model = build_model(DENSE, seed=2)
    batch = packed_batch(3)
    tokens, docs = batch["tokens"][:1], batch["document_ids"][:1]
    _, packed = model(tokens, document_ids=docs, mtp=True)
    for start, end in ((0, 5), (5, 9), (9, 12)):
        _, alone = model(tokens[:, start:end], mtp=True)
        for depth, (p, a) in enumerate(zip(packed, alone, strict=True), start=1):
            n = end - start - depth  # the indices with a label inside the document
            if n > 0:
                torch.testing.assert_close(p[:, start:start + n], a[:, :n], rtol=1e-5, atol=1e-5)


def test_mtp_step_with_a_kv_cache_equals_the_full_sequence():
    """Drafting one position at a time through the paged cache gives the training path's logits at every depth."""
    from megapipe.inference.kv_cache import KVPool, PagedBatch

    model = build_model(DENSE, seed=4).eval()
    tokens = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, full = model(tokens, mtp=True)
        hidden = model(tokens, return_hidden=True)
        cfg, depths = DENSE, DENSE.mtp_num_layers
        pool = KVPool(cfg.num_layers + depths, 4, 4, cfg.kv_heads, cfg.dim_per_head, torch.float32, "cpu")
        for depth in range(1, depths + 1):
            outs = []
            for t in range(tokens.shape[1] - depth):
                cache = PagedBatch(pool)
                positions = cache.plan([([0, 1, 2, 3], t)], [])
                logits, h = model.mtp_step(depth, hidden[:, t:t + 1], tokens[:, t + depth:t + depth + 1], positions,
                                           cache)
                outs.append(h)
                torch.testing.assert_close(logits[0, 0], full[depth - 1][0, t], rtol=1e-5, atol=1e-5)
            hidden = torch.cat(outs, dim=1)


def test_generation_does_not_run_mtp():
    model = build_model(DENSE, seed=0)
    called = []
    model.mtp[0].register_forward_hook(lambda *a: called.append(1))
    model(torch.zeros(1, 4, dtype=torch.long), last_only=True)
    assert not called


def test_training_lowers_the_mtp_losses():
    """A few dozen steps on a repeating sequence: every depth's loss falls well below its start."""
    torch.manual_seed(0)
    model = build_model(DENSE, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    row = torch.arange(17) * 7 % V
    mb = {"tokens": row[None, :-1].repeat(4, 1), "labels": row[None, 1:].repeat(4, 1)}
    firsts, lasts = None, None
    for _ in range(40):
        result = train_step(model, [mb], ParallelDims())
        opt.step()
        opt.zero_grad()
        firsts = firsts or result.metrics
        lasts = result.metrics
    for depth in (1, 2):
        assert lasts[f"mtp/loss_{depth}"] < 0.5 * firsts[f"mtp/loss_{depth}"], (firsts, lasts)


@pytest.mark.parametrize("kw, message", [
    ({"mtp_num_layers": -1}, "model.mtp_num_layers (--mtp-num-layers) = -1 must be >= 0"),
    ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": -0.1}, "--mtp-loss-scaling-factor) = -0.1 must be >= 0"),
    ({"mtp_num_layers": 1, "position_embedding": "learned"}, "needs rotary positions"),
])
def test_config_mistakes(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_mtp(ModelConfig(**kw))


def test_mtp_keeps_every_parallel_layout_and_refuses_the_hf_and_trt_writers():
    """Every layout with MTP runs in tests/parallel/test_dist_layouts.py (V pipeline schedules are refused by
    megapipe.parallel.dims); the writers do not know the MTP tensors."""
    require(DENSE, "pretrain", layouts=["dp_shard", "dp_replicate", "tp", "sp", "pp", "cp"])
    require(moe_cfg(), "pretrain", layouts=["ep", "dp_shard", "tp", "pp", "cp"])
    with pytest.raises(MegapipeError, match="export hf does not support Llama with MTP models"):
        require(DENSE, "export_hf")
