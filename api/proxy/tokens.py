"""The token ids a request is routed by.

A prompt of token ids is used as it is. A model with local files (``--tokenizer``: a model directory
or a ``tokenizer.json``, per model or for every model; nothing downloaded) is tokenized here: text with
its ``tokenizer.json`` (built as ``transformers`` 5.19 builds it for ``LlamaTokenizer``; a
``CodeLlamaTokenizer`` model is left to the workers) and the special tokens ``tokenizer_config.json``
adds to it (special tokens added by its post-processor, as vLLM's completions do), chat rendered by its chat template
(`api.proxy.chat_template`, from ``chat_template.jinja`` and ``additional_chat_templates/`` or else
``tokenizer_config.json`` beside it) and encoded without special tokens (vLLM's default for chat: the
template writes them). Everything else goes to a worker serving the model through its ``/tokenize``
(vLLM's and SGLang's shape), which applies the engine's own template: routing tokens that differ from
the engine's are silent cache misses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers.models import BPE

from api.config import ANY_MODEL
from api.eager import within
from api.proxy.chat_template import ChatTemplate, NotLocal
from api.proxy.segments import SegmentCache, SegmentPlan
from api.proxy.upstream import Upstream, UpstreamError
from api.proxy.wire import ChatBody, ErrorReply, TokenizeReply
from indexer.errors import UNDECODABLE
from indexer.hashing import pack_tokens
from router.errors import ConfigError
from router.types import WorkerConfig

__all__ = ["Encoder", "ModelFiles", "PromptRefused", "PromptTokenizer", "TokenizeFailed", "load_model_files"]

log = logging.getLogger(__name__)

# Longer texts are encoded off the event loop: a byte-level BPE costs ~1.3 us a token (1 ms for a
# 1k-token prompt), more than a hop to a thread (~0.05 ms).
_INLINE_CHARS = 1024
# An engine's /tokenize answers in milliseconds: one silent this long gives its turn to the next worker.
REMOTE_TOKENIZE_TIMEOUT_S = 10.0
# Hugging Face's named special tokens, handed to the chat template.
# A multimodal model's processor files: vLLM renders chat with the processor's template, not read here.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# The tokenizer classes whose own ``__init__`` transformers 5.19 builds the pipeline with, from the
# tokenizer.json's vocabulary and merges only, instead of loading the file as it is. LlamaTokenizer's
# build is repeated here (`_llama`); CodeLlamaTokenizer's also cuts a text at its fill token
# (``<FILL_ME>``, infilling) when it encodes, which is not, so its models are tokenized by the workers.
# Other such classes (Qwen2Tokenizer, GPT2Tokenizer, ...) are loaded as their file is (see the README).
_LLAMA_CLASSES = frozenset(("LlamaTokenizer", "LlamaTokenizerFast"))
_NOT_LOCAL_CLASSES = frozenset(("CodeLlamaTokenizer", "CodeLlamaTokenizerFast"))
# transformers 5.19's TOKENIZER_MAPPING_NAMES, as far as it decides between those classes and the file
# as it is: the model types registered with a class that loads tokenizer.json as it is (TokenizersBackend,
# PreTrainedTokenizerFast, MistralCommonBackend: vLLM asks for no Mistral format), then those registered
# with a Llama class, then those whose registered class wins over the hub's (MODELS_WITH_INCORRECT_HUB_
# TOKENIZER_CLASS) with a class of their own. The first has the types vLLM 0.32 itself loads as they
# are (internlm2, step3_vl, step3p7, unlimited-ocr) too.
_AS_IS_MODEL_TYPES = frozenset((
    "EvollaModel", "arctic", "aria", "bigbird_pegasus", "camembertv2-base", "canary", "chameleon", "chatlm",
    "cohere_asr", "deepseek_ocr", "deepseek_ocr2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4",
    "deepseek_vl", "deepseek_vl_hybrid", "deepseek_vl_v2", "ernie4_5", "ernie4_5_moe", "flex_olmo", "fuyu", "glm",
    "glm4", "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_moe", "glm_image", "glmasr", "got_ocr2", "gpt_bigcode",
    "granite", "granitemoe", "granitemoehybrid", "granitemoeshared", "h2ovl_chat", "hyperclovax", "hyperclovax_vlm",
    "internlm2", "jamba", "janus", "kimi_k25", "kimi_linear", "kosmos-2", "llava", "llava_next", "mimo_v2_flash",
    "minicpm3", "minicpmv", "minicpmv4_6", "minicpmv4_7", "minimax_m2", "ministral", "ministral3", "mistral",
    "mistral3", "mixtral", "modernbert", "modernbert-decoder", "molmo", "molmo2", "nemotron", "nvfp4",
    "nystromformer", "olmo2", "olmo3", "olmo_hybrid", "opencua", "openvla", "paddleocr_vl", "pegasus_x", "persimmon",
    "phi3", "phi3_v", "phimoe", "pix2struct", "pixtral", "smolvlm", "stablelm", "step3_vl", "step3p5", "umt5",
    "vipllava", "voxtral", "voxtral_realtime", "xlm-roberta-xl", "step3p7", "unlimited-ocr", "unlimited_ocr",
))  # fmt: skip
_LLAMA_MODEL_TYPES = {"code_llama": "CodeLlamaTokenizer", "idefics": "LlamaTokenizer", "idefics2": "LlamaTokenizer"}
_OWN_CLASS_MODEL_TYPES = frozenset(
    ("hyperclovax_vision_v2", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp")
)

_decode_tokens = msgspec.json.Decoder(TokenizeReply).decode
_encode = msgspec.json.Encoder().encode


class TokenizeFailed(Exception):
    """No worker could tokenize the prompt."""


class PromptRefused(ValueError):
    """The prompt refused as the engine refuses it: by the chat template here (``raise_exception``), or
    by a worker's ``/tokenize`` (a 400: every worker would refuse it, and so would the engine's route)."""


# Texts waiting for the thread: their special-tokens choice, and the future of their ids.
_Queued = tuple[list[str], bool, "asyncio.Future[list[list[int]]]"]


class Encoder:
    """A model's tokenizer; long texts are encoded on a thread, those queued meanwhile together
    (``encode_batch_fast`` lets go of the GIL and spreads a batch over the cores). With a cache (`segments`),
    a text is cut at its added tokens and only the pieces not seen lately are encoded. The ids come out
    packed (little-endian u32, as routing hashes and books them): a text made of cached pieces is their
    bytes joined, no list of ints built."""

    def __init__(self, tokenizer: Tokenizer, cache_tokens: int = 0, where: str = "every model") -> None:
        self.tokenizer = tokenizer
        self._queued: list[_Queued] = []
        self._busy = False
        self.cache: SegmentCache | None = None
        self._plan: SegmentPlan | None = None
        self._before = self._after = b""  # the plan's ids around a sequence, packed
        if cache_tokens > 0:
            plan = SegmentPlan.of(tokenizer)
            if isinstance(plan, str):
                log.info("%s: tokenizer cache off, texts encoded whole: %s", where, plan)
            else:
                self._plan, self.cache = plan, SegmentCache(cache_tokens)
                self._before, self._after = _packed(plan.before_ids), _packed(plan.after_ids)

    async def encode(self, text: str, *, add_special_tokens: bool) -> bytes:
        if self._plan is None or self.cache is None or not text:
            return _packed(await self._encode_whole(text, add_special_tokens))
        pieces = self._plan.split(text)
        cached: dict[str, bytes] = {}  # looked up now: the cache may drop them while new pieces encode
        # A dict, not a list: a text may hold ~10^5 pieces, and a list's membership test made this loop
        # quadratic, seconds on the event loop for a client's text of many added tokens.
        missing: dict[str, None] = {}
        for piece in pieces:
            if isinstance(piece, str) and piece not in cached and piece not in missing:
                found = self.cache.get(piece)
                if found is None:
                    missing[piece] = None
                else:
                    cached[piece] = found
        if missing:
            if sum(map(len, missing)) <= _INLINE_CHARS:
                lists = self._ids(list(missing), False)
            else:
                lists = await self._on_thread(list(missing), False)
            for piece, ids in zip(missing, lists, strict=True):
                cached[piece] = packed = _packed(ids)
                self.cache.put(piece, packed)
        parts = [self._before] if add_special_tokens else []
        for piece in pieces:
            parts.append(_packed((piece,)) if isinstance(piece, int) else cached[piece])
        if add_special_tokens:
            parts.append(self._after)
        return b"".join(parts)

    async def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= _INLINE_CHARS:
            return self._ids([text], add_special_tokens)[0]
        return (await self._on_thread([text], add_special_tokens))[0]

    async def _on_thread(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The texts' ids, encoded on the thread with whatever else is queued (one future for them all:
        a future each cost more on the loop than the encoding of a short piece)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[list[int]]] = loop.create_future()
        self._queued.append((texts, add_special_tokens, future))
        if not self._busy:
            self._next_batch(loop)
        return await future

    def _ids(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The texts' ids by ``encode_batch_fast``, which tracks no offsets: 15-33 % less CPU than
        ``encode`` for one text and ``encode_batch`` for a batch (docs/performance.md)."""
        return [
            encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        ]

    def _next_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: hands everything queued to a thread (one batch per special-tokens choice)."""
        queued, self._queued = [item for item in self._queued if not item[2].done()], []
        self._busy = bool(queued)
        if queued:
            loop.run_in_executor(None, self._encode_batch, loop, queued)

    def _encode_batch(self, loop: asyncio.AbstractEventLoop, queued: list[_Queued]) -> None:
        """On the thread."""
        results: list[tuple[asyncio.Future[list[list[int]]], list[list[int]] | BaseException]] = []
        for special in (True, False):
            group = [(texts, future) for texts, add, future in queued if add is special]
            if not group:
                continue
            try:
                ids = iter(self._ids([text for texts, _ in group for text in texts], special))
            except Exception as exc:
                results.extend((future, exc) for _, future in group)
            else:  # each request's share of the batch, in order
                results.extend((future, [next(ids) for _ in texts]) for texts, future in group)
        loop.call_soon_threadsafe(self._done, loop, results)

    def _done(
        self, loop: asyncio.AbstractEventLoop,
        results: list[tuple[asyncio.Future[list[list[int]]], list[list[int]] | BaseException]],
    ) -> None:  # fmt: skip
        for future, result in results:
            if future.done():  # its request is gone
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._next_batch(loop)


def _packed(ids: Sequence[int]) -> bytes:
    return bytes(pack_tokens(ids))


@dataclass(frozen=True)
class ModelFiles:
    """A model's tokenizer and chat template (none: chat goes to the engine), loaded once. No encoder:
    the model's files cannot be tokenized here exactly; its prompts go to the workers, even when there
    are files for every model."""

    encoder: Encoder | None
    template: ChatTemplate | None


def load_model_files(paths: dict[str, Path], cache_tokens: int = 0) -> dict[str, ModelFiles]:
    """Each model's files (`ANY_MODEL`: the others'), its encoder caching up to ``cache_tokens`` of its
    texts' pieces (0: none); raises `ConfigError` (setting ``tokenizer``) naming the file that cannot
    be used, in one line. Loaded once a process: the command's check before it starts serving and the
    app share them."""
    loaded = {model: _load(model, path.resolve()) for model, path in paths.items()}
    return {
        model: ModelFiles(None, None)
        if files is None
        else ModelFiles(Encoder(files[0], cache_tokens, _where(model)), files[1])
        for model, files in loaded.items()
    }


def _where(model: str) -> str:
    return "every model" if model == ANY_MODEL else f"model {model!r}"


@functools.lru_cache(maxsize=64)
def _load(model: str, path: Path) -> tuple[Tokenizer, ChatTemplate | None] | None:
    """None: the files are not to be tokenized with here (`_NOT_LOCAL_CLASSES`)."""
    where = _where(model)
    directory, tokenizer_file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
    config = _json_object(directory / "tokenizer_config.json", where)
    tokenizer_class = _tokenizer_class(config, _json_object(directory / "config.json", where, strict=False))
    if tokenizer_class in _NOT_LOCAL_CLASSES:
        log.warning(
            "%s: %s (as transformers 5.19 loads it) encodes a text holding its fill token as an infilling "
            "prompt, which is not repeated here; its prompts are tokenized by the workers", where, tokenizer_class,
        )  # fmt: skip
        return None
    try:
        text = tokenizer_file.read_text(encoding="utf-8")
        tokenizer = Tokenizer.from_str(text)
        # Read as JSON only for a Llama rebuild or an older config's added tokens, and once (a large
        # vocabulary's file takes a fraction of a second a parse).
        older_config = not isinstance(config.get("added_tokens_decoder"), dict)
        contents = json.loads(text) if tokenizer_class in _LLAMA_CLASSES or older_config else {}
        if tokenizer_class in _LLAMA_CLASSES:
            tokenizer = _llama(tokenizer, contents, config)
    except Exception as exc:
        raise ConfigError("tokenizer", f"{where}: cannot load {tokenizer_file}: {_one_line(exc)}") from None
    special_map = _json_object(directory / "special_tokens_map.json", where)
    named, listed = _special_tokens(config, special_map)
    file_added = contents.get("added_tokens") or []
    _add_config_tokens(
        tokenizer, _config_added_tokens(directory, file_added, config, special_map, where), named, listed
    )
    special = {name: str(token) for name, token in named.items()}  # the template's bos_token, ...
    processor = [name for name in _PROCESSOR_FILES if (directory / name).exists()]
    if processor:  # vLLM then prefers the processor's template (when a request has no tools)
        log.info("%s: %s beside %s; chat is tokenized by the workers", where, processor[0], tokenizer_file)
        return tokenizer, None
    templates, sources = _templates(directory, config, where)
    if not templates:
        log.info("%s: no chat template beside %s; chat is tokenized by the workers", where, tokenizer_file)
        return tokenizer, None
    try:
        return tokenizer, ChatTemplate(templates, special)
    except jinja2.TemplateSyntaxError:
        pass
    for name, source in templates.items():  # each alone, to name the file of the one that does not compile
        try:
            ChatTemplate({name: source}, special)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(
                "tokenizer", f"{where}: chat template {sources[name]}: line {exc.lineno}: {exc.message}"
            ) from None
    raise AssertionError("the templates compile one by one but not together")


def _tokenizer_class(config: dict[str, Any], model_config: dict[str, Any]) -> str:
    """The class transformers 5.19's ``AutoTokenizer`` loads a model's files with, as vLLM 0.32 asks it (no
    Mistral format), as far as it matters here: ``tokenizer_config.json``'s ``tokenizer_class`` (else
    ``config.json``'s), unless ``config.json``'s ``model_type`` has a class registered that differs from it
    and loads the file as it is (or, for some types, its own). A tokenizer with its own code
    (``auto_map``) is loaded as its file is, as before."""
    if "auto_map" in config:
        return "TokenizersBackend"
    model_type = model_config.get("model_type")
    named = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    hub = named.removesuffix("Fast") if isinstance(named, str) else None
    if not isinstance(model_type, str) or not model_type:
        return hub or "TokenizersBackend"
    if model_type in _AS_IS_MODEL_TYPES:  # registered with a class that differs from a Llama one
        return "TokenizersBackend" if hub is None or hub in _LLAMA_CLASSES | _NOT_LOCAL_CLASSES else hub
    if model_type in _OWN_CLASS_MODEL_TYPES:
        return "TokenizersBackend"  # its own class, loaded as the file is here (as before)
    return hub or _LLAMA_MODEL_TYPES.get(model_type, "TokenizersBackend")


def _llama(loaded: Tokenizer, contents: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    """The tokenizer transformers 5.19's ``LlamaTokenizer`` builds from a tokenizer.json: its BPE's
    vocabulary and merges in a byte-fallback BPE of its own flags (no ``unk_token``), no normalizer, a
    ``Metaspace`` pre-tokenizer prepending ``▁`` as ``add_prefix_space`` (default true) and ``legacy``
    (default false) ask: ``always`` when legacy, ``first`` when not, ``never`` without a prefix space;
    the file's post-processor. Neither the file's added tokens (only the config's, added after) nor its
    truncation and padding (which transformers lifts to encode) are kept."""
    model = contents.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):
        vocab = {item[0] if isinstance(item, list) else item: index for index, item in enumerate(vocab)}
    merges = [
        tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model.get("merges") or []
    ]
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=[(a, b) for a, b in merges], fuse_unk=True, byte_fallback=True, dropout=None)
    )
    prefix_space = config.get("add_prefix_space")
    legacy = bool(config.get("legacy", False))
    scheme = "never" if prefix_space is not None and not prefix_space else "always" if legacy else "first"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    tokenizer.post_processor = loaded.post_processor
    return tokenizer


def _special_tokens(
    config: dict[str, Any], special_map: dict[str, Any]
) -> tuple[dict[str, str | AddedToken], list[str | AddedToken]]:
    """The named special tokens and the listed extra ones, as ``transformers`` 5.19 reads them. Named:
    ``bos_token`` ... ``mask_token``, then the other ``*_token`` keys (those given as added tokens
    first) and the names of an ``extra_special_tokens`` object. Listed: ``extra_special_tokens``, else
    the older ``additional_special_tokens``. ``special_tokens_map.json`` is read only beside a config
    without ``added_tokens_decoder`` (an older one): then its values win, even over a ``null``."""
    values = dict(config)
    extras = values.pop("extra_special_tokens", None)
    if not extras and "additional_special_tokens" in values:
        extras = values.pop("additional_special_tokens")
    listed = "extra_special_tokens" in config or "additional_special_tokens" in config
    by_name = {key: value for key, value in values.items() if _other_name(key) and isinstance(value, str)}
    for key in by_name:
        del values[key]
    if isinstance(extras, dict):
        by_name |= extras
        extras, listed = None, False
    if "added_tokens_decoder" not in config:
        for key, value in special_map.items():
            if key == "extra_special_tokens" and isinstance(value, list):
                known = list(extras) if isinstance(extras, list) else []
                extras = known + [token for token in value if token not in known]
                listed = True
            elif key == "extra_special_tokens" and isinstance(value, dict):
                by_name |= value
            elif isinstance(value, dict):
                values[key] = _added_token({**value, "special": True})
            else:
                values[key] = value
    if not listed:
        extras = values.get("additional_special_tokens")
    named = {name: _added_token(values.get(name)) for name in _SPECIAL_TOKENS}
    named |= {key: _added_token(value) for key, value in values.items() if _other_name(key) and _token_like(value)}
    named |= {key: _added_token(value) for key, value in by_name.items()}
    tokens = [token for value in extras if (token := _added_token(value))] if isinstance(extras, list) else []
    return {name: token for name, token in named.items() if token is not None}, tokens


def _other_name(key: str) -> bool:
    return key.endswith("_token") and key not in _SPECIAL_TOKENS


def _token_like(value: Any) -> bool:
    """A text, or an added token (in a config's own form: with its ``__type``)."""
    return isinstance(value, (str, AddedToken)) or (isinstance(value, dict) and value.get("__type") == "AddedToken")


def _config_added_tokens(
    directory: Path,
    file_added: list[Any],
    config: dict[str, Any],
    special_map: dict[str, Any],
    where: str,
) -> list[AddedToken]:
    """The added tokens ``transformers`` 5.19 adds first, by their ids: ``tokenizer_config.json``'s
    ``added_tokens_decoder``; without one (an older config), the legacy ``added_tokens.json``'s (special
    when a named or extra special token's text: then not normalized; else normalized), then
    ``tokenizer.json``'s own ``added_tokens`` (again for a file loaded as it is: a no-op)."""
    decoder = config.get("added_tokens_decoder")
    tokens: dict[int, AddedToken] = {}
    if isinstance(decoder, dict):
        tokens = {
            int(key): token for key, entry in decoder.items() if isinstance(token := _added_token(entry), AddedToken)
        }
        return [token for _, token in sorted(tokens.items(), key=lambda item: item[0])]
    legacy = _json_object(directory / "added_tokens.json", where)
    if legacy:
        special = _legacy_special_texts(config, special_map)
        for text, index in legacy.items():
            if isinstance(index, int):
                flags = {"special": text in special, "normalized": text not in special}
                tokens[index] = AddedToken(text, lstrip=False, rstrip=False, **flags)
    for entry in file_added:
        token = _added_token(entry)
        if isinstance(token, AddedToken) and isinstance(entry.get("id"), int):
            tokens[entry["id"]] = token
    return [token for _, token in sorted(tokens.items(), key=lambda item: item[0])]


def _legacy_special_texts(config: dict[str, Any], special_map: dict[str, Any]) -> set[str]:
    """The texts ``transformers`` 5.19 takes for special ones when it reads ``added_tokens.json``: the
    named tokens' (``bos_token`` ... ``mask_token``, ``special_tokens_map.json``'s winning) and the
    listed extra ones', those given as texts (or in the map as objects; a config's object is not one)."""
    values = {name: config.get(name) for name in _SPECIAL_TOKENS}
    extras = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    for key, value in special_map.items():
        text = value.get("content") if isinstance(value, dict) else value
        if key in values:
            values[key] = text
        elif key == "extra_special_tokens" and isinstance(value, list):
            known = list(extras) if isinstance(extras, list) else []
            extras = known + [item.get("content") if isinstance(item, dict) else item for item in value]
    texts = {value for value in values.values() if isinstance(value, str) and value}
    if isinstance(extras, list):
        texts |= {item for item in extras if isinstance(item, str)}
    return texts


def _add_config_tokens(
    tokenizer: Tokenizer, decoder: list[AddedToken], named: dict[str, str | AddedToken], listed: list[str | AddedToken]
) -> None:
    """Adds the tokens ``transformers`` 5.19 adds when it loads a ``tokenizer.json`` (its
    ``TokenizersBackend``), in its order: ``decoder`` (`_config_added_tokens`; again: their flags win),
    then the named special tokens and the listed extra ones that are no added token yet, a text as a
    special token (not normalized); a named one is made special."""
    adding: list[str | AddedToken] = list(decoder)
    known = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    known |= {str(token) for token in adding}
    for value in (*named.values(), *listed):
        if str(value) not in known and value not in adding:
            adding.append(value)
    named_texts = {str(value) for value in named.values()}
    tokens = []
    for value in adding:
        token = AddedToken(value, special=True) if isinstance(value, str) else value
        if not token.special and token.content in named_texts:
            token.special = True
        tokens.append(token)
    if tokens:
        tokenizer.add_tokens(tokens)


def _added_token(value: Any) -> str | AddedToken | None:
    """A token as the files give it: a text, or an added token's fields (``content``, ...)."""
    if isinstance(value, (str, AddedToken)):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return None
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    return AddedToken(value["content"], **{flag: bool(value[flag]) for flag in flags if flag in value})


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _json_object(path: Path, where: str, strict: bool = True) -> dict[str, Any]:
    """The file's object ({} without the file); one that cannot be read raises `ConfigError`, or is {}
    when not ``strict``."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if not strict:
            return {}
        raise ConfigError("tokenizer", f"{where}: cannot read {path}: {_one_line(exc)}") from None
    if not isinstance(value, dict):
        if not strict:
            return {}
        raise ConfigError("tokenizer", f"{where}: {path}: expected a JSON object")
    return value


def _templates(directory: Path, config: dict[str, Any], where: str) -> tuple[dict[str, str], dict[str, Path]]:
    """The chat templates by name, and the file each comes from, as ``transformers`` 5 loads them: the
    template files (``chat_template.jinja``, the default, and ``additional_chat_templates/<name>.jinja``,
    named by their stem) if there are any, all of them and nothing of ``tokenizer_config.json``; else
    its ``chat_template`` (a string, or a list of ``{"name", "template"}``)."""
    files = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = directory / "chat_template.jinja"
    if (directory / "additional_chat_templates").is_dir():  # after the default, as transformers reads them
        files.update(
            (path.name.removesuffix(".jinja"), path)
            for path in (directory / "additional_chat_templates").glob("*.jinja")
        )
    if files:
        templates = {}
        for name, path in files.items():
            try:
                templates[name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError("tokenizer", f"{where}: cannot read {path}: {_one_line(exc)}") from None
        return templates, files
    config_file = directory / "tokenizer_config.json"
    given = config.get("chat_template")
    if given is None:
        return {}, {}
    if isinstance(given, str):
        return {"default": given}, {"default": config_file}
    if isinstance(given, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        for item in given
    ):
        return {item["name"]: item["template"] for item in given}, {item["name"]: config_file for item in given}
    raise ConfigError("tokenizer", f"{where}: {config_file}: chat_template is neither a string nor a list of templates")


class PromptTokenizer:
    def __init__(
        self, local: dict[str, ModelFiles], upstream: Upstream, counted: Callable[[str], None] = lambda source: None
    ) -> None:
        """``counted``: told where each prompt's tokens came from, ``local`` or ``engine``."""
        self._local = local
        self._upstream = upstream
        self._counted = counted
        self._turn = 0  # the workers take turns at tokenizing

    def _files(self, model: str) -> tuple[Encoder, ChatTemplate | None] | None:
        """The model's encoder and template (its own files, else those for every model); none: the workers
        tokenize its prompts (no files, or files not tokenized here)."""
        files = self._local.get(model) or self._local.get(ANY_MODEL)
        if files is None or files.encoder is None:
            return None
        return files.encoder, files.template

    async def text(
        self, model: str, text: str, workers: Sequence[WorkerConfig], add_special_tokens: bool = True
    ) -> bytes:
        """The text's ids, packed (little-endian u32)."""
        files = self._files(model)
        if files is None:
            body = {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}
            return await self._remote(body, workers)
        self._counted("local")
        return await files[0].encode(text, add_special_tokens=add_special_tokens)

    async def chat(self, request: ChatBody, workers: Sequence[WorkerConfig]) -> bytes:
        """The rendered conversation's ids, packed; raises `PromptRefused` when the model's template (or
        the engine's) refuses the conversation."""
        files = self._files(request.model)
        if files is not None and files[1] is not None:
            try:
                text = files[1].render(request)
            except NotLocal:
                pass
            except jinja2.TemplateError as exc:
                raise PromptRefused(f"the chat template refused the messages: {exc.message}") from None
            else:
                self._counted("local")
                return await files[0].encode(text, add_special_tokens=request.add_special_tokens)
        return await self._remote(request.tokenize_body(), workers)

    async def _remote(self, body: dict[str, Any], workers: Sequence[WorkerConfig]) -> bytes:
        """Ask the workers, starting with the next one's turn, until one answers."""
        self._counted("engine")
        payload = _encode(body)
        problems = []
        self._turn += 1
        start = self._turn % len(workers) if workers else 0
        for worker in (*workers[start:], *workers[:start]):
            assert worker.url is not None
            try:
                exchange = self._upstream.post(worker.url, b"/tokenize", payload, worker.worker_id)
                status, content = await within(REMOTE_TOKENIZE_TIMEOUT_S, exchange)
                if status == 200:
                    return _packed(_decode_tokens(content).tokens)
                if status == 400:  # vLLM's answer to a request it refuses (its template's exception, a bad field)
                    raise PromptRefused(f"worker {worker.worker_id} refused the prompt: {_error_message(content)}")
                problems.append(f"worker {worker.worker_id}: HTTP {status}")
            except UpstreamError as exc:
                problems.append(f"worker {worker.worker_id}: {exc}")
            except TimeoutError:
                problems.append(f"worker {worker.worker_id}: no answer in {REMOTE_TOKENIZE_TIMEOUT_S:g} s")
            except UNDECODABLE as exc:
                problems.append(f"worker {worker.worker_id}: {type(exc).__name__}")
        raise TokenizeFailed("no worker could tokenize the prompt (" + "; ".join(problems or ["none serves it"]) + ")")


_decode_refusal = msgspec.json.Decoder(ErrorReply).decode
# The most of an engine's refusal not in OpenAI's error shape said back to the client.
_RAW_REFUSAL_CHARS = 500


def _error_message(content: bytes) -> str:
    """The message of an engine's error answer (OpenAI's shape), else its text, shortened."""
    try:
        return _decode_refusal(content).error.message
    except UNDECODABLE:
        return content[:_RAW_REFUSAL_CHARS].decode("utf-8", "replace")
