"""Tensor parallelism (troupe.parallel.tensor): T ranks compute the model of one, its loss, its
gradients (each rank's of its shard) and its logits, within float rounding; MoE layers route
as one rank does and dispatch 1/T of the tokens (TED). Ranks are threads with gloo groups."""

import pytest
import torch

from troupe.collectives.threads import run_groups, run_ranks
from troupe.models import GPT, GPTConfig
from troupe.models.moe import MoE
from troupe.parallel import apply_tensor_parallel, full_state_dict
from troupe.parallel.layout import ParallelLayout
from troupe.parallel.tensor import check_heads, layout


BYTES = GPTConfig(vocab_size=257, seq_len=16, n_layer=2, n_head=4, d_model=32)
# SmolLM2's kind of attention (9 query heads over 3 key/value heads), with every option a
# split has to get right: q and k norms, a qkv bias, SwiGLU, an untied output head
LLAMA = GPTConfig(vocab_size=101, seq_len=16, n_layer=2, n_head=9, n_kv_head=3, head_dim=8,
                  d_model=36, d_ff=48, norm="rmsnorm", positions="rope", mlp="swiglu",
                  qk_norm=True, qkv_bias=True, out_bias=False, mlp_bias=False,
                  tie_embeddings=False)
MOE = GPTConfig(**{**BYTES.model_dump(), "moe": dict(num_experts=4, expert_interval=1,
                                                    top_k=2, capacity_factor=1.0)})


def _batch(cfg: GPTConfig, B: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g))


def _reference(cfg: GPTConfig, x, y, coef: float = 0.01):
    model = GPT(cfg, seed=3)
    logits, loss, aux = model(x, y)
    (loss + coef * aux).backward()
    return model, loss.item(), model(x)[0].detach()


def _rank(group, cfg, x, y, coef=0.01):
    model = apply_tensor_parallel(GPT(cfg, seed=3), group)
    none, loss, aux = model(x, y)
    assert none is None  # the logits are never gathered for the loss
    (loss + coef * aux).backward()
    routing = [m.last_routing.experts_SK for m in model.modules() if isinstance(m, MoE)]
    return (loss.item(), {n: p.grad for n, p in model.named_parameters()}, model.tp_layout,
            model(x)[0].detach(), routing)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-6)


@pytest.mark.parametrize("cfg,T", [(BYTES, 2), (BYTES, 4), (LLAMA, 3)],
                         ids=["bytes-T2", "bytes-T4", "llama-9q3kv-T3"])
def test_T_ranks_compute_the_model_of_one(cfg, T):
    x, y = _batch(cfg)
    ref, loss, logits = _reference(cfg, x, y)
    out = run_ranks(T, _rank, cfg, x, y)
    splits = out[0][2]
    assert "tok_emb.weight" in splits and any(".qkv." in n for n in splits)
    for got, _, _, got_logits, _ in out:
        assert abs(got - loss) <= 1e-6 * loss
        assert got_logits.shape == logits.shape and _close(got_logits, logits)
    for name, p in ref.named_parameters():
        if name in splits:  # each rank's gradient is the whole one's of its slice
            grad = splits[name].merge([o[1][name] for o in out])
        else:  # replicated: the same on every rank
            grad = out[0][1][name]
            assert all(torch.allclose(o[1][name], grad, atol=1e-7) for o in out), name
        assert grad.shape == p.grad.shape and _close(grad, p.grad), name


def test_the_vocabulary_is_padded_to_a_multiple_of_T():
    def shapes(group):
        model = apply_tensor_parallel(GPT(BYTES, seed=3), group)
        return model.tok_emb.weight.detach(), full_state_dict(model)
    (first, whole), (last, _) = run_ranks(2, shapes)
    assert first.shape == last.shape == (129, 32)  # 257 -> 258 rows, the last one padding
    assert torch.equal(last[-1], torch.zeros(32))
    ref = GPT(BYTES, seed=3).state_dict()
    assert sorted(whole) == sorted(ref)
    assert all(torch.equal(whole[k], ref[k]) for k in ref)  # the shards put back: the model


def test_moe_routes_as_one_rank_and_dispatches_a_share_of_the_tokens():
    """tp=2 x ep=2 over 4 ranks: every rank routes every token as the single model does; the
    expert-parallel exchange carries each rank's half of the tokens (the duplicates dropped:
    half the bytes of sending them all), and outputs and loss are the model's."""
    x, y = _batch(MOE, B=4)
    ref = GPT(MOE, seed=3)
    _, loss, _ = ref(x, y)
    routing = [m.last_routing.experts_SK for m in ref.modules() if isinstance(m, MoE)]
    whole = ref(x)[0].detach()
    from troupe.parallel import apply_expert_parallel

    def rank(groups, r, drop):
        model = apply_expert_parallel(
            apply_tensor_parallel(GPT(MOE, seed=3), groups["tp"]), groups["ep"])
        for m in model.modules():
            if isinstance(m, MoE):
                m.drop_duplicates = drop
        with torch.no_grad():
            _, got, _ = model(x, y)
            logits = model(x)[0]
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        return (got.item(), logits, [m.last_routing.experts_SK for m in moes],
                sum(m.meter.bytes for m in moes))

    grid = ParallelLayout.of(4, tp=2, ep=2)
    dropped, duplicated = (run_groups(grid.world, grid.groups(), rank, drop) for drop in (True, False))
    for got, logits, experts, _ in dropped + duplicated:
        assert abs(got - loss.item()) <= 1e-5 * loss.item() and _close(logits, whole)
        assert all(torch.equal(a, b) for a, b in zip(experts, routing))
    sent, all_sent = sum(o[3] for o in dropped), sum(o[3] for o in duplicated)
    assert 0 < sent and abs(sent - all_sent / 2) <= 0.05 * all_sent


def test_moe_gradients_are_the_models_summed_over_the_ranks_of_an_expert():
    x, y = _batch(MOE)
    ref, loss, _ = _reference(MOE, x, y)
    out = run_ranks(2, _rank, MOE, x, y)
    for name, p in ref.named_parameters():
        if getattr(p, "expert", False):  # each rank's tokens' share: reduced with edp's
            grad = out[0][1][name] + out[1][1][name]
        elif name in out[0][2]:
            grad = out[0][2][name].merge([o[1][name] for o in out])
        else:
            grad = out[0][1][name]
        assert _close(grad, p.grad), name
    assert all(torch.equal(a, b) for o in out for a, b in zip(
        o[4], [m.last_routing.experts_SK for m in ref.modules() if isinstance(m, MoE)]))


def test_more_ranks_than_key_value_heads_replicate_them_for_inference():
    cfg = GPTConfig(**{**LLAMA.model_dump(), "n_head": 4, "n_kv_head": 2, "d_model": 32})
    x, _ = _batch(cfg)
    whole = GPT(cfg, seed=3)(x)[0].detach()

    def rank(group):
        model = apply_tensor_parallel(GPT(cfg, seed=3), group, training=False)
        assert model.blocks[0].attn.n_kv == 1 and model.blocks[0].attn.n_head == 1
        with torch.no_grad():
            return model(x)[0]
    assert all(_close(got, whole) for got in run_ranks(4, rank))
    with pytest.raises(ValueError, match=r"one of \[1, 2\]"):
        check_heads(4, 2, 4, training=True)


def test_sizes_that_do_not_split_are_refused_naming_those_that_do():
    with pytest.raises(ValueError, match=r"tensor_parallel=2: model has 9 query and 3 "
                                         r"key/value heads.*one of \[1, 3, 9\]"):
        check_heads(9, 3, 2, training=False)
    with pytest.raises(ValueError, match="d_ff=48, which 5 ranks do not split"):
        layout(GPT(GPTConfig(**{**BYTES.model_dump(), "n_head": 5, "d_model": 40,
                                "d_ff": 48})), 5)


def test_a_split_cuts_and_merges_back():
    split = layout(GPT(LLAMA), 3)["blocks.0.attn.qkv.weight"]
    whole = torch.randn(split.whole, 36)
    parts = [split.shard(whole, r) for r in range(3)]
    assert all(p.shape == (3 * 8 + 2 * 8, 36) for p in parts)  # 3 query heads, 1 k, 1 v
    assert torch.equal(split.merge(parts), whole)


def test_engines_of_three_ranks_decode_the_tokens_of_one():
    """Greedy decoding over 9 query and 3 key/value heads split over 3 ranks (each caching
    its own key/value head), in the native one-call decode step where this machine builds it
    (its row-parallel products and the logits called back for the all-reduce and gather):
    the tokens of the unsplit engine, for 32 tokens of two prompts of different lengths."""
    from troupe.generation import ContinuousBatcher, SamplingParams
    cfg = GPTConfig(**{**LLAMA.model_dump(), "seq_len": 64, "qkv_bias": False})
    prompts = [[5, 17, 3, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]]

    def generate(model):
        engine = ContinuousBatcher(model, eos_id=0, max_batch=4)
        for i, p in enumerate(prompts):
            engine.add(str(i), p, SamplingParams(max_tokens=32, temperature=0.0))
        return engine.run(), engine.fused is not None, model.cache_heads

    whole, fused, heads = generate(GPT(cfg, seed=3).eval())
    assert heads == 3 and all(len(t) == 32 for t in whole.values())
    out = run_ranks(3, lambda g: generate(
        apply_tensor_parallel(GPT(cfg, seed=3), g, training=False).eval()))
    assert all(tokens == whole and f == fused and h == 1 for tokens, f, h in out)


@pytest.mark.gpu
def test_the_split_computes_on_cuda_tensors():
    """The tensor-parallel maths on CUDA tensors (one GPU: two NCCL ranks cannot share it, so
    the ranks' collectives are gloo's, which moves CUDA tensors through the host): the loss,
    logits and gradients of the whole model on the GPU, within float rounding."""
    x, y = _batch(LLAMA)
    ref = GPT(LLAMA, seed=3).cuda()
    _, loss, _ = ref(x.cuda(), y.cuda())
    loss.backward()

    def rank(group):
        model = apply_tensor_parallel(GPT(LLAMA, seed=3), group).cuda()
        _, got, _ = model(x.cuda(), y.cuda())
        got.backward()
        return got.item(), {n: p.grad.cpu() for n, p in model.named_parameters()}, \
            model.tp_layout
    out = run_ranks(3, rank)
    assert all(abs(o[0] - loss.item()) <= 1e-5 * loss.item() for o in out)
    for name, p in ref.named_parameters():
        splits = out[0][2]
        grad = splits[name].merge([o[1][name] for o in out]) if name in splits else out[0][1][name]
        assert _close(grad, p.grad.cpu(), 1e-4), name
