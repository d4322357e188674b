"""Hugging Face Qwen3.5 checkpoints: load (both kinds) against a float64 NumPy forward of
transformers' equations, save -> load bitwise, sharded load, generation, every loader error.

Two checkpoints cover the config space with two model compiles:
- A: ``Qwen3_5ForCausalLM``, tied head, K != V, GVA (2 key heads, 4 value heads), conv 4,
  eps 1e-6, 4 layers (interval pattern), one safetensors file.
- B: ``Qwen3_5ForConditionalGeneration`` (text under ``model.language_model``, plus vision and
  ``mtp`` tensors to skip), untied head, K == V, conv 3, eps 1e-5, 8 layers in an irregular
  pattern, legacy top-level rope keys, a sharded index.
"""

import json
import logging

import hf_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax import sharding
from gdn_jax.convert import hf_state_dict, load_hf_model, save_hf_model
from gdn_jax.models import PRESETS, HybridConfig, HybridLM, generate, generation, get_config
from gdn_jax.models.attention import apply_rotary
from gdn_jax.testing import rel_rms

CONFIG_A = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "eos_token_id": 3,
}
_TYPES_B = ["linear", "full", "linear", "linear", "linear", "full", "full", "linear"]
CONFIG_B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "vocab_size": 80,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 3,
        "rms_norm_eps": 1e-5,
        "layer_types": [t + "_attention" for t in _TYPES_B],
        "rope_theta": 1_000_000.0,  # legacy top-level rope keys
        "partial_rotary_factor": 0.25,
    },
    "vision_config": {"depth": 1},
}
# Tensors of a ConditionalGeneration checkpoint that are not the text model.
EXTRA_B = {
    "model.visual.patch_embed.proj.weight": np.ones((8, 3, 2, 2), np.float32),
    "model.visual.blocks.0.attn.qkv.weight": np.ones((24, 8), np.float32),
    "mtp.fc.weight": np.ones((32, 64), np.float32),
}


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    tensors = ref.random_tensors(CONFIG_A, seed=0)
    path = ref.write_checkpoint(tmp_path_factory.mktemp("a"), CONFIG_A, tensors)
    return path, tensors


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    tensors = ref.random_tensors(CONFIG_B, seed=1)
    path = ref.write_checkpoint(
        tmp_path_factory.mktemp("b"), CONFIG_B, {**tensors, **EXTRA_B}, shards=3
    )
    return path, tensors


@pytest.fixture(scope="module")
def model_a(ckpt_a):
    return load_hf_model(ckpt_a[0], implementation="xla")


@nnx.jit
def _logits_and_loss(model, ids):
    logits = model(ids[:, :-1])
    loss, _ = model.loss(model.hidden(ids[:, :-1]), ids[:, 1:], chunk=None)
    return logits, loss


def _check_forward(model, config, tensors, T, seed):
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, (2, T + 1))
    want = ref.forward(config, tensors, ids[:, :-1])
    logits, loss = _logits_and_loss(model, jnp.asarray(ids, jnp.int32))
    assert rel_rms(logits, want) <= 1e-5, rel_rms(logits, want)
    want_loss = ref.cross_entropy(want, ids[:, 1:])
    assert abs(float(loss) - want_loss) <= 1e-5 * abs(want_loss)


def test_causal_lm_matches_hf_equations(model_a, ckpt_a):
    path, tensors = ckpt_a
    c = model_a.config
    assert c.tie_embeddings and c.zero_centered_norm and c.layer_pattern is None
    assert (c.linear_head_dim, c.linear_v_head_dim, c.linear_num_v_heads) == (16, 8, 4)
    _check_forward(model_a, CONFIG_A, tensors, T=40, seed=0)


def test_conditional_generation_matches_hf_equations(ckpt_b, caplog):
    path, tensors = ckpt_b
    with caplog.at_level(logging.WARNING, logger="gdn_jax.convert"):
        model = load_hf_model(path, implementation="xla")
    msgs = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(msgs) == 1 and "2 vision-tower" in msgs[0] and "1 multi-token" in msgs[0], msgs
    c = model.config
    assert c.layer_types == tuple("attention" if t == "full" else t for t in _TYPES_B)
    assert (c.conv_kernel, c.norm_eps, c.tie_embeddings, c.rope_theta) == (3, 1e-5, False, 1e6)
    _check_forward(model, CONFIG_B, tensors, T=70, seed=1)  # two GDN chunks


def test_text_only_mrope_is_plain_rope():
    c = {"head_dim": 16, "rope_parameters": CONFIG_A["rope_parameters"]}
    T = 9
    same = np.broadcast_to(np.arange(T), (3, 1, T))
    cos, sin = ref.rope_cos_sin(c, same)
    x = np.random.default_rng(0).normal(size=(1, T, 1, 16))
    r = cos.shape[-1]
    half = lambda y: np.concatenate([-y[..., r // 2 : r], y[..., : r // 2]], -1)
    want = x[..., :r] * cos[:, :, None] + half(x) * sin[:, :, None]
    got = apply_rotary(
        jnp.asarray(x, jnp.float32), jnp.arange(T)[None], rotary_dim=r, theta=10_000.0
    )
    np.testing.assert_allclose(np.asarray(got)[..., :r], want, atol=2e-6)
    # Distinct streams (images) do change the embedding: the reduction is not vacuous.
    mixed = same.copy()
    mixed[1] += 5
    assert not np.allclose(ref.rope_cos_sin(c, mixed)[0], cos)


def test_real_qwen3_5_0_8b_config_is_the_preset():
    # Qwen/Qwen3.5-0.8B config.json (its text_config and top-level keys that matter here).
    real = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "num_hidden_layers": 24,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6,
            "full_attention_interval": 4,
            "max_position_embeddings": 262144,
            "eos_token_id": 248044,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
            },
        },
    }
    real["text_config"]["layer_types"] *= 6
    assert HybridConfig.from_hf(real) == PRESETS["qwen3_5_0_8b"]
    cfg = PRESETS["qwen3_5_0_8b"]
    assert HybridConfig.from_hf(cfg.to_hf()) == cfg
    irregular = get_config("tiny", zero_centered_norm=True, layer_pattern=["attention"] * 4)
    assert HybridConfig.from_hf(irregular.to_hf()) == irregular
    with pytest.raises(ValueError, match="layer_pattern"):
        get_config("tiny", layer_pattern=("linear",) * 3)
    with pytest.raises(NotImplementedError, match="zero_centered_norm"):
        get_config("tiny").to_hf()
    with pytest.raises(NotImplementedError, match="variant"):
        get_config("tiny", variant="kda", zero_centered_norm=True).to_hf()


def _read_all(path):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_save_load_round_trip_bitwise(model_a, ckpt_a, ckpt_b, tmp_path):
    # f32, single file -> several shards with an index.
    _, tensors = ckpt_a
    save_hf_model(model_a, tmp_path / "a", max_shard_bytes=20_000)
    assert (tmp_path / "a" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "a").glob("model-*-of-*.safetensors"))) > 1
    saved = _read_all(tmp_path / "a")
    assert saved.keys() == tensors.keys()
    for k, x in tensors.items():
        assert saved[k].dtype == x.dtype and np.array_equal(saved[k], x), k
    again = load_hf_model(tmp_path / "a")
    for a, b in zip(
        jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model_a)), strict=True
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # bf16 ConditionalGeneration -> bf16 CausalLM: the text tensors, renamed.
    path_b, tensors_b = ckpt_b
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in tensors_b.items()}
    src = ref.write_checkpoint(tmp_path / "b16", CONFIG_B, {**bf16, **EXTRA_B})
    model_b = load_hf_model(src, param_dtype=jnp.bfloat16)
    save_hf_model(model_b, tmp_path / "b16_out")
    saved = _read_all(tmp_path / "b16_out")
    renamed = {k.replace("model.language_model.", "model."): v for k, v in bf16.items()}
    assert saved.keys() == renamed.keys()
    for k, x in renamed.items():
        assert saved[k].dtype == x.dtype and np.array_equal(saved[k], x), k
    config = json.loads((tmp_path / "b16_out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["model_type"] == "qwen3_5_text"
    assert HybridConfig.from_hf(config) == model_b.config
    assert dict(hf_state_dict(model_b)).keys() == renamed.keys()


def test_sharded_load_places_only_shards(model_a, ckpt_a):
    mesh = sharding.make_mesh("fsdp=4,tensor=2")
    model = load_hf_model(ckpt_a[0], mesh=mesh, implementation="xla")
    split = 0
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    want = dict(nnx.to_flat_state(nnx.state(model_a, nnx.Param)))
    for path, var in flat.items():
        x = var[...]
        assert x.sharding.mesh.shape == mesh.shape, path
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        div = [
            int(np.prod([mesh.shape[a] for a in ((s,) if isinstance(s, str) else s)])) if s else 1
            for s in spec
        ]
        shard_shape = tuple(n // d for n, d in zip(x.shape, div, strict=True))
        assert len(x.addressable_shards) == 8
        for shard in x.addressable_shards:
            assert shard.data.shape == shard_shape, (path, shard.data.shape, shard_shape)
        split += shard_shape != x.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[path][...]))
    embed = flat[("embed", "embedding")][...]
    assert embed.addressable_shards[0].data.shape == (32, 8)  # vocab / tensor, embed / fsdp
    assert split > len(flat) // 2


def test_generate_greedy_is_forward_argmax(model_a):
    rng = np.random.default_rng(3)
    lengths = np.array([5, 11, 8])
    prompts = rng.integers(0, 64, (3, 11)).astype(np.int32)
    new = 6
    out = np.asarray(generate(model_a, prompts, max_new_tokens=new, prompt_lengths=lengths))
    assert out.shape == (3, new) and out.dtype == np.int32
    # Each sequence = its prompt + its new tokens; right padding to the compiled length (T=40)
    # of the forward test cannot change earlier positions (causal).
    full = np.zeros((3, 41), np.int32)
    for b, n in enumerate(lengths):
        full[b, :n], full[b, n : n + new] = prompts[b, :n], out[b]
    logits, _ = _logits_and_loss(model_a, jnp.asarray(full))
    argmax = np.asarray(jnp.argmax(logits, -1))
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(argmax[b, n - 1 : n - 1 + new], out[b])
    # Same shapes again: no new compile of the decode loop.
    size = generation._decode_loop._cache_size()
    prompts2 = (prompts + 1) % 64
    out2 = np.asarray(generate(model_a, prompts2, max_new_tokens=new, prompt_lengths=lengths))
    assert generation._decode_loop._cache_size() == size
    assert not np.array_equal(out2, out)
    # eos: a row stops after its first eos; rows without it are unchanged.
    eos = int(out[0, 2])
    stopped = np.asarray(
        generate(model_a, prompts, max_new_tokens=new, prompt_lengths=lengths, eos_token_id=eos)
    )
    assert generation._decode_loop._cache_size() == size
    for b in range(3):
        hits = np.flatnonzero(out[b] == eos)
        if hits.size == 0:
            np.testing.assert_array_equal(stopped[b], out[b])
        else:
            first = hits[0]
            np.testing.assert_array_equal(stopped[b, : first + 1], out[b, : first + 1])
            assert (stopped[b, first + 1 :] == eos).all()
    assert (stopped[0, 3:] == eos).all()
    # Sampling with filters that leave only the top token equals greedy.
    sampled = generate(
        model_a,
        prompts,
        max_new_tokens=new,
        prompt_lengths=lengths,
        temperature=0.7,
        top_k=2,
        top_p=1e-6,
        rng=jax.random.key(0),
    )
    np.testing.assert_array_equal(np.asarray(sampled), out)


def test_generate_bad_arguments(model_a):
    p = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="prompts"):
        generate(model_a, np.zeros((4,), np.int32), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts"):
        generate(model_a, p.astype(np.float32), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model_a, p, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(model_a, p, max_new_tokens=2, prompt_lengths=np.array([0, 4]))
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(model_a, p, max_new_tokens=2, prompt_lengths=np.array([4]))
    with pytest.raises(ValueError, match="rng"):
        generate(model_a, p, max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model_a, p, max_new_tokens=2, top_k=3)
    with pytest.raises(ValueError, match="top_p"):
        generate(model_a, p, max_new_tokens=2, temperature=1.0, top_p=0.0, rng=jax.random.key(0))


def _variant(tmp_path, config, tensors, name):
    return ref.write_checkpoint(tmp_path / name, config, tensors)


def test_loader_errors(ckpt_a, tmp_path):
    _, t = ckpt_a
    key = "model.layers.1.linear_attn.in_proj_z.weight"
    missing = {k: v for k, v in t.items() if k != key}
    with pytest.raises(ValueError, match=rf"lacks tensor '{key}'; expected shape \(32, 32\)"):
        load_hf_model(_variant(tmp_path, CONFIG_A, missing, "missing"))
    extra = {**t, "model.layers.0.mlp.bias": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.bias' of shape \(3,\)"):
        load_hf_model(_variant(tmp_path, CONFIG_A, extra, "extra"))
    key = "model.layers.3.self_attn.q_proj.weight"
    bad = {**t, key: np.zeros((64, 32), np.float32)}
    with pytest.raises(ValueError, match=rf"'{key}' has shape \(64, 32\); expected \(128, 32\)"):
        load_hf_model(_variant(tmp_path, CONFIG_A, bad, "shape"))
    head = {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1}
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_hf_model(_variant(tmp_path, CONFIG_A, head, "head"))
    for mt in ("qwen3_5_moe", "qwen3_next"):
        with pytest.raises(NotImplementedError, match="mixture-of-experts"):
            load_hf_model(_variant(tmp_path, dict(CONFIG_A, model_type=mt), t, mt))
    with pytest.raises(ValueError, match="model_type='llama'"):
        load_hf_model(_variant(tmp_path, dict(CONFIG_A, model_type="llama"), t, "llama"))
    yarn = dict(CONFIG_A, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(NotImplementedError, match="rope_type='yarn'"):
        load_hf_model(_variant(tmp_path, yarn, t, "yarn"))
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(CONFIG_A))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_model(tmp_path / "empty")
    with pytest.raises(NotImplementedError, match="zero_centered_norm"):
        tiny = nnx.eval_shape(lambda: HybridLM(get_config("tiny", num_layers=1), rngs=nnx.Rngs(0)))
        save_hf_model(tiny, tmp_path)


def test_transformers_runs_our_checkpoints(model_a, ckpt_a, ckpt_b, tmp_path):
    """Where torch and transformers are installed (the GPU machine): transformers' own
    Qwen3_5ForCausalLM (on the CPU, f32) matches the NumPy reference on the test checkpoints,
    loads what save_hf_model writes (both kinds' sources), and matches our model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = np.random.default_rng(5).integers(0, 64, (2, 41))

    def hf_logits(path, ids):
        m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        with torch.no_grad():
            return m.eval()(torch.as_tensor(ids[:, :-1])).logits.double().numpy()

    want_a = ref.forward(CONFIG_A, ckpt_a[1], ids[:, :-1])
    assert rel_rms(hf_logits(ckpt_a[0], ids), want_a) <= 1e-5
    save_hf_model(model_a, tmp_path / "a")
    assert rel_rms(hf_logits(tmp_path / "a", ids), want_a) <= 1e-5
    save_hf_model(load_hf_model(ckpt_b[0]), tmp_path / "b")
    ids_b = ids % 80
    want_b = ref.forward(CONFIG_B, ckpt_b[1], ids_b[:, :-1])
    assert rel_rms(hf_logits(tmp_path / "b", ids_b), want_b) <= 1e-5
    with jax.default_matmul_precision("highest"):
        ours, _ = _logits_and_loss(model_a, jnp.asarray(ids, jnp.int32))
    assert rel_rms(ours, want_a) <= 1e-5
