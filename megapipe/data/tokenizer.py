"""Tokenizers: train a byte-level BPE, and load any local Hugging Face tokenizer behind one small wrapper.

The wrapper encodes with ``gigatoken`` (a Rust BPE engine with ids identical to HF ``tokenizers``, many times
faster) when it accepts the ``tokenizer.json`` and agrees with HF on a probe text, and with HF ``tokenizers``
otherwise. Ids never include template tokens (BOS/EOS added by a post-processor): end-of-document tokens are
appended explicitly, as Megatron's ``--append-eod`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from megapipe.data.readers import first_line
from megapipe.errors import DataError
from megapipe.fileio import write_bytes_atomic

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
# Files a Hugging Face tokenizer directory may hold; save() copies the ones present.
# a vision-language model's image / video processor settings travel with its tokenizer
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
HF_FILES = (TOKENIZER_FILE, CONFIG_FILE, SPECIAL_MAP_FILE, "added_tokens.json", "vocab.json", "merges.txt",
            "chat_template.jinja", "chat_template.json", *PROCESSOR_FILES)

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")
PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "<|padding|>", "[PAD]", "<|finetune_right_pad_id|>")

# Text the fast backend must encode exactly like HF tokenizers before it is trusted (scripts, digits, spaces,
# special tokens written inline).
PARITY_PROBE = (
    "The quick brown fox, 1234567 times!\n\n  Indented\tline.  "
    "Café naïve 日本語のテキスト Ελληνικά русский текст عربى हिन्दी 한국어 🙂👍🏽 "
    + EOD_TOKEN + " end"
)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the other 68 for
    the characters from U+0100 on, in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _byte_level_alphabet()


class Tokenizer:
    """A loaded tokenizer. Use :func:`load_tokenizer` to make one."""

    def __init__(self, path: Path, json_text: str, config: dict):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        self._json_text = json_text
        self._config = config
        self._hf = HFTokenizer.from_str(json_text)
        self._fast = _load_gigatoken(json_text, self._hf)
        self.backend = "gigatoken" if self._fast is not None else "tokenizers"
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        specials = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        self.eod_id = _pick_token(self._hf, specials, config.get("eos_token"), EOD_CANDIDATES)
        pad = _pick_token(self._hf, specials, config.get("pad_token"), PAD_CANDIDATES)
        self.pad_id = pad if pad is not None else self.eod_id

    def __repr__(self) -> str:
        return f"Tokenizer({self.path}, vocab_size={self.vocab_size}, backend={self.backend})"

    def __getstate__(self):
        return {"path": self.path, "json_text": self._json_text, "config": self._config}

    def __setstate__(self, state):
        self.__init__(state["path"], state["json_text"], state["config"])

    @property
    def fingerprint(self) -> str:
        """What identifies this tokenizer in a dataset's sidecar: a hash of its vocabulary (token -> id, added tokens
        included) and of its ids for a probe text, so it depends on what the tokenizer does, not on how its JSON was
        formatted or which tool saved it."""
        if getattr(self, "_fingerprint", None) is None:
            import xxhash

            vocab = sorted(self._hf.get_vocab(with_added_tokens=True).items())
            probe = self._hf.encode(PARITY_PROBE, add_special_tokens=False).ids
            text = json.dumps({"vocab": vocab, "probe": probe}, ensure_ascii=False, separators=(",", ":"))
            self._fingerprint = "xxh3_128:" + xxhash.xxh3_128(text.encode("utf-8")).hexdigest()
        return self._fingerprint

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's ids; ``add_special_tokens``: with the tokens the tokenizer puts around a text (HF's default,
        and vLLM's for a completion's prompt: a BOS for Llama, Gemma, Mistral; none for GPT-2-style BPE)."""
        ids = self.encode_batch([text])[0]
        if add_special_tokens:
            before, after = self.added_tokens
            ids = before + ids + after
        return ids

    @property
    def added_tokens(self) -> tuple[list[int], list[int]]:
        """The ids tokenizer.json's post-processor puts before and after a text when special tokens are added, as
        transformers' tokenizer (5.x) puts them; its tokenizer_config.json's add_bos_token / add_eos_token do not
        decide there, and do not here."""
        if getattr(self, "_added", None) is None:
            plain = self._hf.encode(PARITY_PROBE, add_special_tokens=False).ids
            full = self._hf.encode(PARITY_PROBE, add_special_tokens=True).ids
            at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
            if at is None:
                raise DataError(f"the tokenizer {self.path} changes a text's own tokens when it adds special "
                                f"tokens (its post-processor); megapipe cannot add them to a prompt")
            self._added = (full[:at], full[at + len(plain):])
        return self._added

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no template tokens added)."""
        flat, offsets = self.encode_batch_arrays(texts)
        flat = flat.tolist()
        return [flat[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]

    def encode_batch_arrays(self, texts: list[str], parallel: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids concatenated (uint32) and the int64 offsets where each text starts (len(texts)+1).

        ``parallel`` (gigatoken): use its thread pool (None: yes, except inside a worker process). HF tokenizers
        decide for themselves (``TOKENIZERS_PARALLELISM``).
        """
        if self._fast is not None:
            layout = self._fast.encode_batch(texts, parallel=parallel).layout
            offsets = np.asarray(layout.offsets.data, dtype=np.int64)
            flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]]
            return flat, offsets - offsets[0]
        encodings = self._hf.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
        offsets = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((i for e in encodings for i in e.ids), np.uint32, int(offsets[-1]))
        return flat, offsets

    def reference_encode_batch(self, texts: list[str]) -> list[list[int]]:
        """HF ``tokenizers`` ids, whatever the fast backend: the reference parity tests compare against."""
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The token's own string in the vocabulary (byte-level BPE's "Ġthe"), not its decoded text."""
        return self._hf.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, also where it holds part of a UTF-8 character (which its decoded text
        shows as U+FFFD): a byte-level BPE token's characters mapped back to bytes, a byte-fallback token
        ``<0xNN>`` as byte NN; else its decoded text's UTF-8."""
        cache = self.__dict__.setdefault("_token_bytes", {})
        if token not in cache:
            text = self.decode([token])
            piece = self._hf.id_to_token(int(token))
            if "\ufffd" not in text or piece is None:
                cache[token] = text.encode("utf-8")
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                cache[token] = bytes([int(piece[3:5], 16)])
            elif all(c in _BYTE_OF_CHAR for c in piece):
                cache[token] = bytes(_BYTE_OF_CHAR[c] for c in piece)
            else:
                cache[token] = text.encode("utf-8")
        return cache[token]

    def save(self, directory: str | Path) -> Path:
        """Write the Hugging Face files (tokenizer.json, tokenizer_config.json, special_tokens_map.json) to a dir."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        source_dir = self.path if self.path.is_dir() else None
        if source_dir is not None:
            for name in HF_FILES:
                if (source_dir / name).is_file():
                    write_bytes_atomic(out / name, (source_dir / name).read_bytes())
        else:
            write_bytes_atomic(out / TOKENIZER_FILE, self._json_text.encode("utf-8"))
        if not (out / CONFIG_FILE).is_file():
            _write_json(out / CONFIG_FILE, self._config or self._default_config())
        if not (out / SPECIAL_MAP_FILE).is_file():
            _write_json(out / SPECIAL_MAP_FILE, self._special_tokens_map())
        return out

    def _special_tokens_map(self) -> dict:
        name = self._hf.id_to_token
        return _special_tokens_map(name(self.eod_id) if self.eod_id is not None else None,
                                   name(self.pad_id) if self.pad_id is not None else None)

    def _default_config(self) -> dict:
        return _config_for(self._special_tokens_map())


def _special_tokens_map(eod: str | None, pad: str | None) -> dict:
    names = {"bos_token": eod, "eos_token": eod} if eod is not None else {}
    if pad is not None:
        names["pad_token"] = pad
    return names


def _config_for(special_tokens_map: dict) -> dict:
    """A tokenizer_config.json that makes ``transformers.AutoTokenizer`` load tokenizer.json as it is."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000_000,
        "clean_up_tokenization_spaces": False,
        **special_tokens_map,
    }


def tokenizer_files(path: str | Path) -> tuple[Path, dict]:
    """(tokenizer.json, tokenizer_config.json contents) of a tokenizer directory or tokenizer.json file."""
    p = Path(path).expanduser()
    file = p / TOKENIZER_FILE if p.is_dir() else p
    if not file.is_file():
        raise DataError(f"tokenizer {path} has no {TOKENIZER_FILE}")
    config_file = file.parent / CONFIG_FILE
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"tokenizer config {config_file} is not valid JSON ({first_line(e)})") from None
    return file, config if isinstance(config, dict) else {}


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a local Hugging Face tokenizer directory (holding tokenizer.json) or a tokenizer.json file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"tokenizer {path} does not exist (give a Hugging Face tokenizer directory or tokenizer.json)")
    file = p / TOKENIZER_FILE if p.is_dir() else p
    if not file.is_file():
        raise DataError(f"tokenizer directory {path} has no {TOKENIZER_FILE} (only fast Hugging Face tokenizers load)")
    try:
        text = file.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"tokenizer file {file} is not a readable tokenizer.json ({first_line(e)})") from None
    config = {}
    config_file = file.parent / CONFIG_FILE
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DataError(f"tokenizer config {config_file} is not valid JSON ({first_line(e)})") from None
    try:
        return Tokenizer(p, text, config if isinstance(config, dict) else {})
    except Exception as e:  # tokenizers raises a bare Exception for a JSON that is not a tokenizer
        raise DataError(f"tokenizer file {file} is not a Hugging Face tokenizer ({first_line(e)})") from None


def _load_gigatoken(json_text: str, hf):
    """The gigatoken engine for this tokenizer, or None when it refuses it or disagrees with HF on the probe."""
    if os.environ.get("MEGAPIPE_TOKENIZER_BACKEND", "") == "tokenizers":
        return None
    try:
        import gigatoken

        fast = gigatoken.Tokenizer.from_json(json_text)
        got = [int(i) for i in fast.encode(PARITY_PROBE)]
    except Exception:
        return None
    return fast if got == hf.encode(PARITY_PROBE, add_special_tokens=False).ids else None


def _pick_token(hf, specials: dict, configured, candidates) -> int | None:
    if isinstance(configured, dict):
        configured = configured.get("content")
    if isinstance(configured, str) and hf.token_to_id(configured) is not None:
        return hf.token_to_id(configured)
    for name in candidates:
        if name in specials:
            return specials[name]
    return None


def _write_json(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def train_tokenizer(texts, vocab_size: int, output: str | Path, eod_token: str = EOD_TOKEN,
                    pad_token: str = PAD_TOKEN, min_frequency: int = 2, source: str = "the input",
                    special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE on an iterable of strings; write a Hugging Face tokenizer directory.

    Ids 0 and 1 are the end-of-document and padding tokens; ``special_tokens`` (e.g. ChatML's) follow from id 2.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = [eod_token, pad_token]
    if eod_token == pad_token:
        raise DataError(f"--eod-token and --pad-token are both {eod_token!r}; give two different tokens")
    for token in special_tokens:
        if not token or token in specials:
            raise DataError(f"--special-token {token!r} is empty or given twice (special tokens so far: "
                            f"{', '.join(specials)})")
        specials.append(token)
    if vocab_size < 256 + len(specials):
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{256 + len(specials)} (256 bytes + {len(specials)} special tokens)")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise DataError(f"tokenizer output {out} exists and is not a directory")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = [0]

    def counted():
        for text in texts:
            seen[0] += 1
            yield text

    tok.train_from_iterator(counted(), trainer)
    if not seen[0]:
        raise DataError(f"{source} holds no text to train the tokenizer on")
    names = _special_tokens_map(eod_token, pad_token)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(out / TOKENIZER_FILE, tok.to_str(pretty=True).encode("utf-8"))
        _write_json(out / CONFIG_FILE, _config_for(names))
        _write_json(out / SPECIAL_MAP_FILE, names)
    except OSError as e:
        raise DataError(f"cannot write the tokenizer to {out} ({e.strerror}: {e.filename})") from None
    return load_tokenizer(out)
