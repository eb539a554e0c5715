import pytest
import torch

from raychat.masks import make_batch
from raychat.model import GPT, ModelConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT(
        ModelConfig.from_depth(2, vocab_size=97, max_seq_len=32, aspect_ratio=32, head_dim=16)
    ).init_weights(0)
    # zero-initialized output projections make every block the identity: perturb them so the test
    # exercises attention across positions
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.eval()


def test_from_depth_derives_sizes():
    c = ModelConfig.from_depth(4, vocab_size=4096, max_seq_len=256)
    assert (c.n_embd, c.n_head, c.n_kv_head, c.head_dim, c.intermediate_size) == (256, 4, 4, 64, 704)
    c = ModelConfig.from_depth(20, vocab_size=65536, max_seq_len=2048, head_dim=128, kv_group=2)
    assert (c.n_embd, c.n_head, c.n_kv_head) == (1280, 10, 5)
    c = ModelConfig.from_depth(3, vocab_size=10, max_seq_len=8, aspect_ratio=50, head_dim=64)
    assert c.n_embd == 192  # 150 rounded up to a multiple of 64


@pytest.mark.parametrize("depth", [0, -1])
def test_bad_depth_is_a_clear_error(depth):
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        ModelConfig.from_depth(depth, vocab_size=10, max_seq_len=8)


def test_parameter_names_follow_qwen3():
    m = GPT(ModelConfig.from_depth(1, vocab_size=11, max_seq_len=8, aspect_ratio=64, head_dim=32))
    names = set(m.state_dict())
    for n in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]:
        assert n in names
    assert not any("bias" in n for n in names)


def test_param_count_and_flops_by_hand():
    c = ModelConfig.from_depth(1, vocab_size=10, max_seq_len=8, aspect_ratio=64, head_dim=32)
    # width 64, 2 heads of 32, mlp 192 (8/3*64=170.7 -> 192)
    m = GPT(c)
    d, v, f, hd = 64, 10, 192, 32
    per_layer = 4 * d * d + 3 * d * f + 2 * d + 2 * hd
    assert m.num_params() == v * d + per_layer + d + d * v
    assert m.flops_per_token(8) == 6 * (per_layer + d + d * v) + 12 * 1 * 2 * 32 * 8


def test_second_document_logits_inside_a_packed_row_equal_its_logits_alone(model):
    bos = 1
    row = torch.tensor([[1, 2, 3, 1, 4, 5, 6, 7, 8]])  # documents [1,2,3] and [1,4,5,6,7,8]; T+1 = 9
    b = make_batch(row, bos, document_masking=True)
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert b["loss_mask"][0, 2].item() is False  # last token of document 1 has no target
    packed = model(b["input_ids"], position_ids=b["position_ids"], segment_ids=b["segment_ids"])
    alone = model(torch.tensor([[1, 4, 5, 6, 7]]))
    torch.testing.assert_close(packed[0, 3:], alone[0], atol=1e-5, rtol=0)
    first_alone = model(torch.tensor([[1, 2, 3]]))
    torch.testing.assert_close(packed[0, :3], first_alone[0], atol=1e-5, rtol=0)
    # without the document mask the second document sees the first: logits differ
    plain = model(b["input_ids"])
    assert (plain[0, 3:] - alone[0]).abs().max() > 1e-4


def test_gqa_runs_and_matches_shapes():
    c = ModelConfig.from_depth(2, vocab_size=50, max_seq_len=16, aspect_ratio=64, head_dim=32, kv_group=2)
    m = GPT(c).init_weights(1)
    assert m.model.layers[0].self_attn.k_proj.weight.shape == (c.n_kv_head * 32, 128)
    assert m(torch.randint(0, 50, (2, 16))).shape == (2, 16, 50)


def test_rope_rotates_each_half_pair_by_position_times_frequency():
    """Rotate-half RoPE (HF Llama/Qwen) worked by hand for head_dim 4, theta 10,000: frequencies 1 and
    10000^(-1/2) = 0.01; pairs (x0, x2) and (x1, x3) rotate by p * frequency; position 0 is the identity."""
    import math

    from raychat.model import apply_rope, rope_cos_sin

    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4).expand(1, 1, 2, 4)
    cos, signed_sin = rope_cos_sin(torch.tensor([[0, 1]]), 4, 10000.0)
    assert cos.shape == signed_sin.shape == (1, 1, 2, 4)
    y = apply_rope(x, cos, signed_sin)[0, 0]
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    expected = [[1.0, 2.0, 3.0, 4.0], [c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + s1, 4 * c2 + 2 * s2]]
    torch.testing.assert_close(y, torch.tensor(expected), rtol=1e-6, atol=1e-6)
