"""A tiny MLX chat model rigged to answer the same way whatever it is asked, built at test time.

A random-weight model never emits a tool call, a natural stop or a ``<think>`` block, so
the behaviours that fooled the proxy's detectors on real servers never happen with it.
This model's answer is fixed by what kind of request it gets, not by its words:

* a request with ``tools`` gets a ``write_file`` tool call of about 40 tokens in the
  Hermes/Qwen wire form (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``),
  then EOS (:data:`TOOL_CALL`); with ``short_tool_call=True`` the model is built with a
  short ``get_time`` call instead (:data:`SHORT_TOOL_CALL`);
* a request whose last message mentions ``think`` gets ``<think>...</think>`` then a
  short answer, then EOS (:data:`REASONING`);
* a request whose last message mentions ``forever`` gets :data:`LOOP` over and over
  until ``max_tokens`` (a long stream, to disconnect from or to run two at once);
* any other request gets exactly :data:`WORDS_N` words, then EOS (:data:`WORDS`): a
  natural stop after a known number of tokens.

How: the chat template ends the prompt with a selector token (``<|rig_tool|>``,
``<|rig_think|>``, ``<|rig_loop|>`` or ``<|rig_words|>``) chosen from the request as above. Every layer's
attention and MLP output projections are zero, so the last hidden state is the embedding
of the last token; each chain token (selectors included) has a one-hot embedding, and an
untied ``lm_head`` maps each chain token to its successor and the last one to EOS. The
tokenizer splits on spaces only (then byte-level BPE), and is trained so that every
space-led piece of the rigged answers is one token: the rigged answers re-encode to
exactly the tokens generated, as with a real tokenizer. ``<tool_call>``, ``</tool_call>``,
``<think>`` and ``</think>`` are added (non-special) tokens, as in Qwen's tokenizers, so
token-based tool and reasoning detection (mlx_lm) engages as well as text-based parsers.
A token has one successor, so the short and the long tool call cannot live in one model
(both start with ``<tool_call>``): hence the two builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .tinymodel import SPECIAL_TOKENS, TRAINING_TEXT

__all__ = [
    "LOOP",
    "REASONING",
    "REASONING_ANSWER",
    "REASONING_THOUGHT",
    "RiggedModel",
    "SHORT_TOOL_CALL",
    "TOOL_CALL",
    "WORDS",
    "WORDS_N",
    "answer_always",
    "build_rigged_model",
]

SELECTORS = ("<|rig_tool|>", "<|rig_think|>", "<|rig_loop|>", "<|rig_words|>")
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>")

_CONTENT_WORDS = (
    "Apples bananas cherries dates elderberries figs grapes honeydew kiwis lemons mangoes "
    "nectarines oranges papayas quinces raspberries strawberries tangerines ugli vanilla "
    "watermelons yams zucchini apricots blueberries cranberries gooseberries guavas limes lychees plums."
)
#: The long tool call's arguments (a JSON object, as the server returns it).
TOOL_ARGUMENTS = {"path": "notes/fruit.txt", "content": _CONTENT_WORDS}
#: The long tool call, as the model writes it (about 40 tokens with the markup).
TOOL_CALL = '<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps(TOOL_ARGUMENTS) + "}\n</tool_call>"
SHORT_TOOL_ARGUMENTS = {"zone": "UTC"}
#: The short tool call (7 tokens with the markup).
SHORT_TOOL_CALL = (
    '<tool_call>\n{"name": "get_time", "arguments": ' + json.dumps(SHORT_TOOL_ARGUMENTS) + "}\n</tool_call>"
)
#: The natural stop: this many words (one token each), then EOS. Fewer than the burst check's
#: 20 tokens: the rigged model decodes far faster than any real one, and vllm-mlx and Rapid-MLX
#: then send a short answer's events in one read (a burst that real models never produce).
WORDS_N = 16
WORDS = "Alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa"
REASONING_THOUGHT = "\nThe user asks for the weather; a short answer will do.\n"
REASONING_ANSWER = "\n\nIt is sunny today."
REASONING = "<think>" + REASONING_THOUGHT + "</think>" + REASONING_ANSWER
#: The endless answer: these twelve words over and over, to ``max_tokens`` (one token each).
LOOP = " one two three four five six seven eight nine ten eleven twelve"

#: ChatML with tools rendered (Hermes style, so tool parsers engage: ``tool_call.name`` is
#: what mlx_lm looks for) and the selector token at the end of the generation prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for tc in message['tool_calls'] %}{%- set tool_call = tc['function'] if tc['function'] is defined else tc %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if tools %}<|rig_tool|>"
    "{%- elif 'think' in (messages[-1]['content'] | string) %}<|rig_think|>"
    "{%- elif 'forever' in (messages[-1]['content'] | string) %}<|rig_loop|>"
    "{%- else %}<|rig_words|>{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class RiggedModel:
    path: Path
    #: the rigged answers' token counts (without EOS)
    tool_tokens: int
    think_tokens: int  # <think> ... </think> inclusive
    answer_tokens: int  # after </think>
    words_tokens: int
    #: the tool call this build writes (TOOL_CALL or SHORT_TOOL_CALL)
    tool_call: str


def _pieces(text: str) -> list[str]:
    """How the rig's tokenizer cuts ``text``: at the markup tokens, then before each space."""
    out: list[str] = []
    rest = text
    while rest:
        cut = min(((rest.find(m), m) for m in MARKUP if m in rest), default=None)
        head, mark = (rest, None) if cut is None else (rest[: cut[0]], cut[1])
        piece = ""
        for ch in head:
            if ch == " " and piece:
                out.append(piece)
                piece = ""
            piece += ch
        if piece:
            out.append(piece)
        if mark is None:
            break
        out.append(mark)
        rest = rest[cut[0] + len(mark) :]  # type: ignore[index]
    return out


def build_rigged_model(dir: Path, *, short_tool_call: bool = False, vocab_size: int = 1500) -> RiggedModel:
    """Write the rigged model into ``dir`` (created) and return its facts. Needs mlx, mlx_lm, tokenizers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tool_call = SHORT_TOOL_CALL if short_tool_call else TOOL_CALL
    answers = {"<|rig_tool|>": tool_call, "<|rig_think|>": REASONING, "<|rig_loop|>": LOOP, "<|rig_words|>": WORDS}

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(" "), behavior="merged_with_next"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[*SPECIAL_TOKENS, *SELECTORS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = TRAINING_TEXT.splitlines(keepends=True)
    for text in answers.values():
        corpus += [p for p in _pieces(text) if p not in MARKUP] * 8
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKUP])
    tok.save(str(dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *SELECTORS)}
    eos = ids["<|im_end|>"]

    chains: dict[str, list[int]] = {}
    seen: dict[int, str] = {}
    for sel, text in answers.items():
        enc = tok.encode(text, add_special_tokens=False).ids
        if len(enc) != len(_pieces(text)) or tok.decode(enc) != text:
            raise RuntimeError(f"the rig's tokenizer does not cut {text!r} into its pieces: {enc}")
        for t in enc:
            if t in seen:
                raise RuntimeError(
                    f"token {tok.id_to_token(t)!r} is in two places ({seen[t]}, {sel}): one successor only"
                )
            seen[t] = sel
        chains[sel] = [ids[sel], *enc]
    states = [t for chain in chains.values() for t in chain]
    hidden = 64 * ((len(states) + 63) // 64)

    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
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
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
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
        elif name.endswith("norm.weight"):
            weights[name] = mx.ones_like(weights[name])
    dim = {t: d for d, t in enumerate(states)}
    embed = [[0.0] * hidden for _ in range(vocab)]
    head = [[0.0] * hidden for _ in range(vocab)]
    for chain in chains.values():
        for k, t in enumerate(chain):
            embed[t][dim[t]] = 1.0
            nxt = chain[k + 1] if k + 1 < len(chain) else (chain[1] if chain[0] == ids["<|rig_loop|>"] else eos)
            head[nxt][dim[t]] = 8.0  # logit 8 * sqrt(hidden) after the final RMSNorm; all others 0
    weights["model.embed_tokens.weight"] = mx.array(embed, dtype=mx.float32)
    weights["lm_head.weight"] = mx.array(head, dtype=mx.float32)
    mx.eval(weights)
    mx.save_safetensors(str(dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    think_end = REASONING.index("</think>") + len("</think>")
    return RiggedModel(
        path=dir,
        tool_tokens=len(chains["<|rig_tool|>"]) - 1,
        think_tokens=len(tok.encode(REASONING[:think_end], add_special_tokens=False).ids),
        answer_tokens=len(tok.encode(REASONING_ANSWER, add_special_tokens=False).ids),
        words_tokens=len(chains["<|rig_words|>"]) - 1,
        tool_call=tool_call,
    )


#: The generation prompt's selector, as the chat template writes it (see CHAT_TEMPLATE).
_SELECTOR = (
    "{%- if tools %}<|rig_tool|>"
    "{%- elif 'think' in (messages[-1]['content'] | string) %}<|rig_think|>"
    "{%- elif 'forever' in (messages[-1]['content'] | string) %}<|rig_loop|>"
    "{%- else %}<|rig_words|>{% endif %}"
)


def answer_always(rig: RiggedModel, selector: str) -> None:
    """Make ``rig`` give the one answer ``selector`` starts, whatever it is asked (tools included):
    for agent CLIs, whose requests always offer tools the rig's ``write_file`` is not among, and
    whose long prompts may mention ``think`` or ``forever`` anywhere."""
    if selector not in SELECTORS:
        raise ValueError(f"unknown selector {selector!r}")
    cfg_path = rig.path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if _SELECTOR not in cfg["chat_template"]:
        raise RuntimeError("rigged chat template changed: cannot fix its answer")
    cfg["chat_template"] = cfg["chat_template"].replace(_SELECTOR, selector)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
