"""A tiny MLX model rigged to write real text of the hard kinds, built at test time.

A random-weight model writes junk of its tokenizer's favourite pieces; the usage check
must also stay silent on text whose tokens are long (deeply indented code, long words) or
not English at all. This model writes such text whatever it is asked, through the real
``mlx_lm.server`` (its detokenizer, its usage accounting), so the proxy's estimates meet it:

* the tokenizer is a byte-level BPE trained on :data:`PASSAGES` (plus the tiny model's
  training text) with a vocabulary large enough that whole words, indentation runs and
  CJK phrases become single tokens, as in a real model's tokenizer;
* every layer's attention and MLP output projections are zero, so the last hidden state
  is the embedding of the last token; the embeddings of the passages' tokens are one-hot,
  and an untied ``lm_head`` maps each to its successor in its passage: the model is a
  fixed chain of tokens, whatever came before the last one;
* a passage's tokens are kept only up to the first token already used by any passage
  (a token has one successor); the last token leads back to the passage's first (a cycle:
  the reply runs to ``max_tokens``) or, for every other passage, to EOS (a natural stop);
* the chat template is just the messages' contents, so the prompt's last token picks
  where in which passage the reply starts: send the text of a chain token (see
  :func:`build_fixed_text_model`'s return value) as the last message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .tinymodel import SPECIAL_TOKENS, TRAINING_TEXT

__all__ = ["PASSAGES", "FixedTextModel", "build_fixed_text_model"]

#: Real text of the kinds that fooled the usage check: code with deep indentation, long
#: words, and non-English scripts (Cyrillic, CJK, accented Latin).
PASSAGES: dict[str, str] = {
    "python": (
        "class ConfigurationRepository:\n"
        "    def resolve_environment(self, requested_environment):\n"
        "        for candidate in self.available_environments:\n"
        "            if candidate.matches(requested_environment):\n"
        "                while candidate.is_refreshing():\n"
        "                    candidate.wait_for_refresh(timeout_seconds=30)\n"
        "                return candidate\n"
        "        raise LookupError(requested_environment)\n"
    ),
    "yaml": (
        "services:\n"
        "  gateway:\n"
        "    deployment:\n"
        "      replicas: 3\n"
        "      containers:\n"
        "        - name: proxy\n"
        "          resources:\n"
        "            limits:\n"
        "              memory: 512Mi\n"
    ),
    "long_words": (
        "Internationalization responsibilities notwithstanding, telecommunications "
        "infrastructure misunderstandings characteristically overshadow "
        "counterrevolutionary electroencephalography."
    ),
    "german": (
        "Die Donaudampfschifffahrtsgesellschaft veröffentlichte Rechtsschutzversicherungsgesellschaften "
        "gegenüber außergewöhnlich umfangreiche Geschwindigkeitsbegrenzungen."
    ),
    "russian": (
        "Быстрая коричневая лиса перепрыгивает через ленивую собаку, "
        "пока измерительный прокси считает токены в потоке событий."
    ),
    "chinese": "敏捷的棕色狐狸跳过了懒狗。测量代理在服务器和客户端之间转发每一个请求，并记录首个词元的时间。",
    "japanese": "素早い茶色の狐は怠け者の犬を飛び越える。計測プロキシはすべての要求を転送し、最初のトークンまでの時間を記録する。",
    "mixed": "Ünïcödé façade — naïve café résumé; Ελληνικά γράμματα και العربية والعبرית עברית 🚀🌍✨.",
}


#: How the CJK passages split into words (the training text of their tokens).
CJK_WORDS: dict[str, str] = {
    "chinese": "敏捷 的 棕色 狐狸 跳过 了 懒 狗 。 测量 代理 在 服务器 和 客户端 之间 转发 每 一个 请求 ， 并 记录 首个 词元 的 时间",
    "japanese": "素早い 茶色 の 狐 は 怠け者 の 犬 を 飛び越える 。 計測 プロキシ は すべて の 要求 を 転送 し 、 最初 の トークン まで の 時間 を 記録 する",
}


@dataclass(frozen=True)
class FixedTextModel:
    path: Path
    #: (passage name, the text of a chain token to end a prompt with, the reply that follows
    #: it up to the passage's end, whether the reply then stops (EOS) or cycles)
    starts: tuple[tuple[str, str, str, bool], ...]


def _template() -> str:
    return "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_fixed_text_model(dir: Path, *, vocab_size: int = 4000) -> FixedTextModel:
    """Write the rigged model into ``dir`` (created) and return where replies can start."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # CJK is trained as the words it is made of (no spaces in the passages), so its tokens
    # are one or two characters as in real tokenizers, not whole sentences
    corpus = (
        TRAINING_TEXT.splitlines(keepends=True)
        + [p for k, p in PASSAGES.items() if k not in CJK_WORDS for _ in range(3)]
        + [w for words in CJK_WORDS.values() for w in words.split()]
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    vocab = tok.get_vocab_size()
    tok.save(str(dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos = ids["<|im_end|>"]

    # the chains: runs of a passage's tokens not taken yet (a token has one successor)
    used: set[int] = set(ids.values())
    chains: list[tuple[str, list[int], bool]] = []
    for name, text in PASSAGES.items():
        run: list[int] = []
        for t in [*tok.encode(text, add_special_tokens=False).ids, -1]:
            if t in used or t < 0:
                if len(run) >= 3:
                    chains.append((name, run, len(chains) % 2 == 1))  # every other chain ends with EOS
                run = []
                continue
            used.add(t)
            run.append(t)
    states = [t for _, chain, _ in chains for t in chain]
    hidden = 64 * ((len(states) + 63) // 64)  # one dimension per chain token

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    (dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
    (dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "model_max_length": 8192,
                "clean_up_tokenization_spaces": False,
                "chat_template": _template(),
            },
            indent=2,
        )
        + "\n"
    )

    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])  # each layer adds nothing: h = embedding
    dim = {t: d for d, t in enumerate(states)}
    embed = [[0.0] * hidden for _ in range(vocab)]
    head = [[0.0] * hidden for _ in range(vocab)]
    starts = []
    for name, chain, stops in chains:
        for k, t in enumerate(chain):
            embed[t][dim[t]] = 1.0
            nxt = chain[k + 1] if k + 1 < len(chain) else (eos if stops else chain[0])
            head[nxt][dim[t]] = 8.0  # logit 8 * sqrt(hidden) after the final RMSNorm; all others 0
            text = tok.decode([t])
            if tok.encode(text, add_special_tokens=False).ids == [t]:  # a prompt ending in it ends in t
                starts.append((name, text, tok.decode(chain[k + 1 :]), stops))
    weights["model.embed_tokens.weight"] = mx.array(embed, dtype=mx.float32)
    weights["lm_head.weight"] = mx.array(head, dtype=mx.float32)
    for name in list(weights):
        if name.endswith("norm.weight"):
            weights[name] = mx.ones_like(weights[name])
    mx.eval(weights)
    mx.save_safetensors(str(dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return FixedTextModel(dir, tuple(starts))
