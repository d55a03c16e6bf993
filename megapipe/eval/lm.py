"""A megapipe checkpoint (any layout, quantized or not) or a Hugging Face directory as an lm-eval model.

Registered in lm-eval's model registry as ``megapipe`` (importing this module registers it)::

    lm_eval.simple_evaluate(model="megapipe", model_args={"pretrained": "runs/x/latest"}, tasks=[...])

Every request runs on the inference engine (megapipe.inference.LLMEngine): log-likelihoods through its prompt
log-probabilities (megapipe.eval.scoring), generation through its sampler and stop strings. Requests are tokenized
and windowed exactly as lm-eval's own Hugging Face model (``hf``, HFLM) does, so the two give the same scores on the
same weights (tests/eval/test_parity.py).

Multimodal tasks (lm-eval's ``doc_to_image``: a request's third argument ``{"visual": [images]}``) run generation
on a vision-language model: image i goes where the context writes its i-th ``<image>`` (lm-eval's placeholder; else
before the text), as PIL images or ``data:`` URLs. A text-only model is refused with a sentence, and so are image
log-likelihood requests (multiple choice), which the engine's scoring path does not take.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from megapipe.errors import MegapipeError
from megapipe.eval.scoring import max_scored_len, score
from megapipe.inference import LLMEngine, ParamError, SamplingParams

log = logging.getLogger(__name__)

# generation_kwargs lm-eval tasks use that the engine's sampler takes under the same name
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def _bool(value) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise MegapipeError(f"model argument {value!r} is not a boolean (true / false)")


def template_bos(tokenizer) -> Optional[int]:
    """The token the tokenizer's own template (post-processor) puts before a text, as Hugging Face's
    ``tokenizer.encode`` adds it (Llama's BOS); None when it adds none. megapipe's encode never adds it."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(tokenizer.path)
    hf = HFTokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    extra = len(full) - len(plain)
    return full[0] if extra >= 1 and full[extra:extra + len(plain)] == plain else None


def config_bos(tokenizer) -> Optional[int]:
    """The id of ``bos_token`` in the tokenizer's tokenizer_config.json, if it names one that exists."""
    path = Path(tokenizer.path)
    file = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    try:
        bos = json.loads(file.read_text(encoding="utf-8")).get("bos_token")
    except (OSError, ValueError):
        return None
    if isinstance(bos, dict):
        bos = bos.get("content")
    return tokenizer.token_to_id(bos) if isinstance(bos, str) else None


def _image(value):
    """A ``doc_to_image`` value as a PIL image: one already, or a data: URL string."""
    from megapipe.data.images import open_image

    return open_image(value) if isinstance(value, str) else value


@register_model("megapipe")
class MegapipeLM(TemplateLM):
    """lm-eval's LM interface over the megapipe engine.

    ``pretrained``: checkpoint, run directory or HF model directory (or ``engine``: an LLMEngine already built).
    ``max_length``: the window lm-eval fits requests into (tokens the model sees); default and upper bound
    ``max_model_len - 2`` (the engine feeds the scored token too and keeps one generation slot).
    ``add_bos_token``: prepend BOS to every text; default: as the tokenizer's template does (as HF's encode).
    """

    MULTIMODAL = True  # lm-eval hands image tasks' requests over; a text-only model refuses them (_image_prompts)

    def __init__(self, pretrained: Optional[str] = None, engine=None, batch_size: int | str = 16,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, add_bos_token=None,
                 prefix_token_id: Optional[int] = None, dtype: str = "auto", device: Optional[str] = None,
                 max_model_len: Optional[int] = None, **kwargs):
        super().__init__()
        if kwargs:
            log.warning("megapipe lm-eval model: ignoring arguments %s", ", ".join(sorted(kwargs)))
        if engine is None:
            if pretrained is None:
                raise MegapipeError("the megapipe lm-eval model needs pretrained=CKPT|HF_DIR")

            config = {"max_model_len": int(max_model_len)} if max_model_len else {}
            engine = LLMEngine.from_pretrained(pretrained, device=device, dtype=dtype, **config)
        if engine.tokenizer is None:
            raise MegapipeError(f"checkpoint {pretrained} holds no tokenizer/: lm-eval tasks are text")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.batch_size = self._positive(64 if batch_size == "auto" else batch_size, "batch_size")
        self._max_gen_toks = self._positive(max_gen_toks, "max_gen_toks")
        limit = max_scored_len(engine) - 1
        self._max_length = self._positive(max_length if max_length is not None else limit, "max_length")
        if self._max_length > limit:
            raise MegapipeError(f"max_length = {self._max_length} exceeds what the engine can score: "
                                f"{limit} (its max_model_len {engine.max_model_len} - 2)")
        template = template_bos(self.tokenizer)
        add_bos = _bool(add_bos_token)
        self.add_bos_token = template is not None if add_bos is None else add_bos
        self.bos_id = template if template is not None else config_bos(self.tokenizer)
        if self.add_bos_token and self.bos_id is None:
            raise MegapipeError(f"add_bos_token: tokenizer {self.tokenizer.path} has no BOS token")
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        if self.tokenizer.eod_id is None:
            raise MegapipeError(f"tokenizer {self.tokenizer.path} has no end-of-text token (lm-eval needs one)")

    @staticmethod
    def _positive(value, name: str) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = 0
        if number < 1 or str(number) != str(value).strip():
            raise MegapipeError(f"{name} = {value!r} must be an integer >= 1")
        return number

    # ------------------------------------------------------------------------------------------ lm-eval's surface

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self):
        return self.engine.device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        ids = list(self.tokenizer.encode(string))
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if bos and self.bos_id is not None and not (add_special_tokens is None and ids[:1] == [self.bos_id]):
            ids = [self.bos_id] + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _bar(self, total: int, desc: str, disable: bool):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=disable)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        if any(len(req.args) > 2 and req.args[2] for req in requests):
            raise MegapipeError("image tasks are run by generation (output_type: generate_until): megapipe's engine "
                                "does not score log-likelihoods of prompts with images")
        return super().loglikelihood(requests, disable_tqdm)

    def image_markers(self) -> Optional[str]:
        """The text of one image in a prompt of this model; None when it takes text only."""
        from megapipe.data.images import image_markers

        return image_markers(self.engine.model_config, self.tokenizer)

    def _prompt(self, req, keep: int) -> tuple[list[int], Optional[dict]]:
        """A generation request's token ids (the context's last ``keep``) and its images (None for text only)."""
        visual = req.args[2].get("visual") if len(req.args) > 2 and req.args[2] else None
        if not visual:
            return self.tok_encode(req.args[0], left_truncate_len=keep), None
        from megapipe.data.images import ImageError, ImageProcessor, prompt_with_images

        markers = self.image_markers()
        if markers is None:
            raise MegapipeError("this task gives the model images, but the model takes text only (it has no vision "
                                "tower): evaluate a vision-language checkpoint")
        try:
            ids, images = prompt_with_images(
                req.args[0], [_image(v) for v in (visual if isinstance(visual, (list, tuple)) else [visual])],
                markers, self.tokenizer, ImageProcessor.from_dir(self.tokenizer.path),
                self.engine.model_config.image_token_id)
        except ImageError as e:
            raise MegapipeError(f"an image request of the task: {e}") from None
        if self.add_bos_token and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if len(ids) > keep:  # cutting the context's start could cut an image's tokens
            raise MegapipeError(f"an image request's prompt holds {len(ids)} tokens, over the {keep} that "
                                f"max_length {self.max_length} leaves beside max_gen_toks")
        return ids, images

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(cache key, context ids, continuation ids) -> (log-likelihood of the continuation, was it greedy), with
        HFLM's window: the last max_length + 1 tokens of context + continuation."""
        sequences, scored = [], []
        for _, context, continuation in requests:
            if not continuation:
                raise MegapipeError("lm-eval asked to score an empty continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            sequences.append(whole)
            scored.append(min(len(continuation), len(whole) - 1))
        with self._bar(len(sequences), "megapipe: scoring", disable_tqdm) as bar:
            results = score(self.engine, sequences, scored, self.batch_size, bar.update)
        out = []
        for (key, _, _), r in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, (r.logprob, r.greedy))
            out.append((r.logprob, r.greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of max_length tokens (lm-eval's rolling windows)."""
        from lm_eval import utils

        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _sampling(self, gen_kwargs: dict):
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode([self.eot_token_id]))
        max_gen = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample", False))
        sampling = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}
        if not do_sample:
            sampling["temperature"] = 0.0
        if kwargs:
            log.warning("megapipe lm-eval model: ignoring generation_kwargs %s", ", ".join(sorted(kwargs)))
        if max_gen >= self.max_length:
            raise MegapipeError(f"max_gen_toks = {max_gen} leaves no room for a prompt in max_length = "
                                f"{self.max_length}")
        try:
            params = SamplingParams(max_tokens=max_gen, stop=[s for s in until if s], **sampling)
            params.validate(self.engine.vocab_size)
        except (ParamError, TypeError) as e:
            raise MegapipeError(f"generation_kwargs {gen_kwargs}: {e}") from None
        return params, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, per the task's generation_kwargs) completions up to a stop string, EOS or
        max_gen_toks; the prompt is the context's last max_length - max_gen_toks tokens (as HFLM)."""
        from lm_eval.models.utils import postprocess_generated_text

        out: list[Optional[str]] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        with self._bar(len(requests), "megapipe: generating", disable_tqdm) as bar:
            for members in groups.values():
                params, until = self._sampling(requests[members[0]].args[1])
                keep = self.max_length - params.max_tokens
                for start in range(0, len(members), self.batch_size):
                    chunk = members[start:start + self.batch_size]
                    prompts, images = zip(*(self._prompt(requests[i], keep) for i in chunk), strict=True)
                    for i, result in zip(chunk, self.engine.generate(prompts, params, images=images), strict=True):
                        text = postprocess_generated_text(result.outputs[0].text, until, None)
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(chunk))
        return out
