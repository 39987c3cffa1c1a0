"""Small Qwen3 checkpoints made by transformers, with a locally trained tokenizer and a Qwen-style chat template,
for the fine-tuning tests (no network: everything is built here)."""

import json
from pathlib import Path

import torch

# A ChatML template in the style of Qwen3's: a system message first, then turns between <|im_start|>ROLE and
# <|im_end|>; the last assistant turn after the last user message carries an empty think block, earlier turns
# do not (so the rendering of a prefix is not a prefix of the whole: the trained-token rule must cope). Written
# over several lines as Hub templates are, half of it relying on trim_blocks / lstrip_blocks (the newline after a
# block tag and the indentation before one are not output), half on {%- -%} whitespace control.
TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}
{%- endfor %}
{% for m in messages %}
  {% if m.role == 'user' or (m.role == 'system' and not loop.first) %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
  {% elif m.role == 'assistant' %}
<|im_start|>assistant
    {% if loop.index0 > ns.last_query and loop.last %}
{% generation %}<think>

</think>

{{ m.content }}<|im_end|>{% endgeneration %}

    {% else %}
{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}

    {% endif %}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name two colours."},
        {"role": "assistant", "content": "Red and blue."},
        {"role": "user", "content": "One more?"},
        {"role": "assistant", "content": "Green."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {
            "role": "assistant",
            "content": "Grey waves fold and break,\nsalt wind carries gull voices,\nthe tide keeps its time.",
        },
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning!"},
        {"role": "assistant", "content": "Bonjour ! Comment allez-vous ?"},
    ],
    [
        {"role": "user", "content": "2 + 2 = ?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3 * 7?"},
        {"role": "assistant", "content": "21, since three sevens make twenty-one."},
    ],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    [
        {"role": "user", "content": "List the days of the week."},
        {"role": "assistant", "content": "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday."},
    ],
    [
        {"role": "user", "content": "def add(a, b):\n    return a + b\nExplain."},
        {"role": "assistant", "content": "It returns the sum of its two arguments, a + b."},
    ],
    [
        {"role": "user", "content": "Translate 'cat' to German."},
        {"role": "assistant", "content": "Katze.", "name": None},
        {"role": "user", "content": "And 'dog'?"},
        {"role": "assistant", "content": "Hund."},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "I failed my exam."},
        {"role": "assistant", "content": "I am sorry. One exam does not define you; you can try again."},
    ],
]

TRAIN_TEXT = [
    "the quick brown fox jumps over the lazy dog. The capital of France is Paris; of Germany, Berlin.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday red blue green yellow purple orange",
    "def add(a, b): return a + b  # sums, products, numbers: one two three four five six seven",
    "Bonjour, comment allez-vous ? Katze Hund Maus. You are a helpful assistant. Answer briefly.",
] + [json.dumps(c) for c in CONVERSATIONS]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>"]  # added but not special, as in Qwen3's tokenizer


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (tokenizers) with Qwen's control tokens after the merges; -> tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAIN_TEXT * 4, trainer=trainer)
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(ADDED)
    return tok


def save_tokenizer(d: Path, template: str = TEMPLATE, in_config: bool = False) -> Path:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, as transformers 5 saves it, unless
    ``in_config``: then the template sits in tokenizer_config.json, as on the Hub's Qwen3 checkpoints)."""
    from transformers import PreTrainedTokenizerFast

    d = Path(d)
    ft = PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ft.chat_template = template
    ft.save_pretrained(str(d))
    if in_config:
        (d / "chat_template.jinja").unlink(missing_ok=True)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return d


def qwen3_config(tie: bool, vocab: int = 320, **kw):
    from transformers import Qwen3Config

    args = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    args.update(kw)
    return Qwen3Config(**args)


def make_checkpoint(d: Path, tie: bool, *, shard: str | None = None, dtype=torch.float32, seed: int = 0, **kw) -> Path:
    """A random Qwen3ForCausalLM saved by transformers into ``d`` (``shard``: save_pretrained's max_shard_size),
    with the tokenizer files and a generation_config whose eos is <|im_end|>. The norm weights are drawn away from
    one, so a swapped or dropped norm shows in the logits."""
    from transformers import Qwen3ForCausalLM

    d = Path(d)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(tie, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model = model.to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(d), max_shard_size=shard) if shard else model.save_pretrained(str(d))
    save_tokenizer(d)
    tok = json.loads((d / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return d


def write_jsonl(path: Path, convs=CONVERSATIONS, repeat: int = 1) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for _ in range(repeat) for c in convs))
    return path


def hf_float64(hf_model):
    """transformers' Qwen3 computes its RMSNorm statistics and RoPE's cos/sin tables in float32 whatever the model's
    dtype (both cast to float), which puts ~1e-7 into a float64 comparison. The oracle gets float64 versions of the
    two, same formulas, every other op as transformers runs it (attention: SDPA, in the model's dtype)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rotary = hf_model.model.rotary_emb
    base = rotary.config.rope_parameters["rope_theta"]
    dim = rotary.config.head_dim

    def rope(x, position_ids):
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # [D/2]
        freqs = position_ids[..., None].double() * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def norm(module):
        def forward(h):
            return module.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))

        return forward

    rotary.forward = rope
    for m in hf_model.modules():
        if isinstance(m, Qwen3RMSNorm):
            m.forward = norm(m)
    return hf_model


def load_hf_float64(path, training: bool = False):
    """transformers' Qwen3ForCausalLM from ``path`` in float64 (``hf_float64``), in train or eval mode. The mode is
    set before the float64 patches: transformers' ``train()``/``eval()`` may put its own module forwards back."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, attn_implementation="sdpa")
    return hf_float64(m.train(training))
