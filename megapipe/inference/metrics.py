"""Prometheus metrics of the server, under vLLM's names (``vllm:...``) so the same dashboards read both engines.

Gauges and token counters are read from the engine at scrape time; latency histograms are observed from the
engine's outputs as requests progress.
"""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from megapipe.inference.engine import ITERATION_TOKENS_BUCKETS, RequestOutput
from megapipe.inference.scheduler import now

# vLLM's buckets, so that the same dashboards' heatmaps line up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                         40.0, 80.0)  # between two tokens, and per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # a request's end to end and its phases
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's buckets for a request's token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    def __init__(self, stats, model_name: str, cache_info: dict):
        self.stats, self.model_name, self.cache_info = stats, model_name, cache_info

    def collect(self):
        s = self.stats()
        labels = ["model_name"]
        for name, doc, key in (("vllm:num_requests_running", "Requests in the running batch.", "running"),
                               ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
                               ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                                "kv_cache_usage")):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], float(s[key]))
            yield g
        g = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Waiting requests by reason: capacity (for room "
                              "in the batch or the KV cache), deferred (for a LoRA adapter slot); they sum to "
                              "vllm:num_requests_waiting.", labels=["model_name", "reason"])
        g.add_metric([self.model_name, "capacity"], float(s["waiting"] - s["waiting_deferred"]))
        g.add_metric([self.model_name, "deferred"], float(s["waiting_deferred"]))
        yield g
        h = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step (prompt chunks, decodes "
                                  "and their drafts: what the step's token budget went to).", labels=labels)
        counts, total = s["iteration_tokens"], 0
        buckets = []
        for bound, n in zip([*(str(float(b)) for b in ITERATION_TOKENS_BUCKETS), "+Inf"], counts, strict=True):
            total += n
            buckets.append((bound, total))
        h.add_metric([self.model_name], buckets, float(s["iteration_tokens_sum"]))
        yield h
        if self.cache_info:  # an info metric: one series at 1, the engine's cache configuration in its labels
            g = GaugeMetricFamily("vllm:cache_config_info", "The engine's KV-cache configuration.",
                                  labels=[*self.cache_info, "engine"])
            g.add_metric([*self.cache_info.values(), "0"], 1.0)
            yield g
        for name, doc, key in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
                ("vllm:prompt_tokens", "Prompt tokens of the requests, each once (prefix-cache hits included, "
                 "recomputation after a preemption not: as vLLM counts them).", "prefix_cache_queries"),
                ("vllm:prompt_tokens_cached", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
                ("vllm:generation_tokens", "Tokens generated.", "generation_tokens"),
                ("vllm:num_preemptions", "Sequences preempted (KV cache full) and recomputed later.", "preemptions"),
                ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in an external KV store (none "
                 "here).", None),
                ("vllm:external_prefix_cache_hits", "Prompt tokens found in an external KV store (none here).", None)):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], float(s[key]) if key else 0.0)
            yield c
        c = CounterMetricFamily("vllm:admission_rejections", "Requests refused by a queue limit, by reason "
                                "(--max-queue: max_num_queued_reqs; no limit on queued tokens here).",
                                labels=["model_name", "reason"])
        c.add_metric([self.model_name, "max_num_queued_reqs"], float(s.get("admission_rejections", 0)))
        c.add_metric([self.model_name, "max_num_queued_tokens"], 0.0)
        yield c
        queries, hits = float(s["prefix_cache_queries"]), float(s["prefix_cache_hits"])
        for name, doc, values in (
                ("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from (they sum to "
                 "vllm:prompt_tokens).", {"local_compute": queries - hits, "local_cache_hit": hits,
                                          "external_kv_transfer": 0.0}),
                ("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the tier that held them (the "
                 "engine's own pool: device).", {"device": hits, "host": 0.0, "p2p": 0.0, "disk": 0.0,
                                                 "external_unspecified": 0.0})):
            c = CounterMetricFamily(name, doc, labels=["model_name", "source"])
            for source, value in values.items():
                c.add_metric([self.model_name, source], value)
            yield c
        if "spec_decode_num_drafts" in s:
            yield from self._speculative(s)
        if "max_lora" in s:  # vLLM's: one series, the adapters in its labels, its value the time of the scrape
            g = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests.",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(s["max_lora"]), ",".join(s["running_lora_adapters"]),
                          ",".join(s["waiting_lora_adapters"])], time.time())  # wall-clock time, as vLLM's
            yield g

    def _speculative(self, s: dict):
        """Speculative decoding (megapipe.inference.speculative), vLLM's counters and its acceptance-rate gauge."""
        for name, doc, key in (
                ("vllm:spec_decode_num_drafts", "Verification steps with drafts.", "spec_decode_num_drafts"),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_decode_num_draft_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(s[key]))
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each draft position (1 = the first draft).",
                                labels=["model_name", "position"])
        for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"], start=1):
            c.add_metric([self.model_name, str(pos)], float(n))
        yield c
        g = GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate",
                              "Accepted / proposed draft tokens, overall and per draft position (label position).",
                              labels=["model_name", "position"])
        g.add_metric([self.model_name, "all"], float(s["spec_decode_acceptance_rate"]))
        for pos, rate in enumerate(s["spec_decode_acceptance_rate_per_pos"], start=1):
            g.add_metric([self.model_name, str(pos)], float(rate))
        yield g


class ServerMetrics:
    """``stats``: the engine's stats (LLMEngine.stats); ``cache_info``: its cache_config_info labels."""

    def __init__(self, stats, model_name: str, max_model_len: int, cache_info: Optional[dict] = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(stats, model_name, cache_info or {}))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        tokens = token_buckets(max_model_len)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, **kw)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=TOKEN_LATENCY_BUCKETS, **kw)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=REQUEST_LATENCY_BUCKETS, **kw)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", buckets=tokens, **kw)
        self.gen_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", buckets=tokens,
                                 **kw)
        self.prefill_computed = Histogram("vllm:request_prefill_kv_computed_tokens", "Prompt tokens a request "
                                          "computed (its prefix-cache hits not).", buckets=tokens, **kw)
        self.max_sample_tokens = Histogram("vllm:request_max_num_generation_tokens", "The most tokens one of a "
                                           "request's n samples generated.", buckets=tokens, **kw)
        self.preemptions = Histogram("vllm:request_num_preemptions", "Times a request was preempted.",
                                     buckets=PREEMPTION_BUCKETS, **kw)
        # a finished request's phases, as vLLM splits them: queued (arrival to its first step), prefill (to its first
        # token), decode (first to last token), inference (first step to last token), and the mean time per output
        # token after the first
        self.phases = {name: Histogram(f"vllm:request_{name}_time_seconds", doc, buckets=REQUEST_LATENCY_BUCKETS,
                                       **kw)
                       for name, doc in (("queue", "Time a request waited for its first step."),
                                         ("prefill", "Time from a request's first step to its first token."),
                                         ("decode", "Time from a request's first token to its last."),
                                         ("inference", "Time from a request's first step to its last token."))}
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "A request's decode time per output token after the first.",
                              buckets=TOKEN_LATENCY_BUCKETS, **kw)
        self.n = Histogram("vllm:request_params_n", "The n request parameter.", buckets=N_BUCKETS, **kw)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens in force for a request (where "
                                    "unset, what the context has room for).", buckets=tokens, **kw)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        for histogram in (self.ttft, self.itl, self.e2e, self.prompt_len, self.gen_len, self.prefill_computed,
                          self.max_sample_tokens, self.preemptions, *self.phases.values(), self.tpot, self.n,
                          self.max_tokens):
            histogram.labels(model_name)  # each series there from the start, at zero (as vLLM's)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self._last: dict[str, tuple[int, float]] = {}  # request id -> (tokens seen, time of the last)

    def observe(self, out: RequestOutput) -> None:
        """Called by the engine thread for every output."""
        label = self.model_name
        tokens = out.num_generated_tokens
        seen, last = self._last.get(out.request_id, (0, None))
        t = out.metrics.get("last_token_time")
        if tokens > seen and t is not None:
            if seen == 0 and out.metrics.get("first_token_time") is not None:
                self.ttft.labels(label).observe(out.metrics["first_token_time"] - out.metrics["arrival_time"])
            elif last is not None:
                self.itl.labels(label).observe(max(0.0, t - last))
            self._last[out.request_id] = (tokens, t)
        if out.finished:
            self._last.pop(out.request_id, None)
            self.e2e.labels(label).observe(now() - out.metrics["arrival_time"])
            self.prompt_len.labels(label).observe(len(out.prompt_token_ids))
            self.gen_len.labels(label).observe(tokens)
            self.prefill_computed.labels(label).observe(len(out.prompt_token_ids) - out.num_cached_tokens)
            self.preemptions.labels(label).observe(out.metrics.get("num_preemptions", 0))
            self.max_sample_tokens.labels(label).observe(out.metrics.get("max_sample_tokens", tokens))
            reasons = {o.finish_reason for o in out.outputs}
            self.success.labels(label, _reason(reasons)).inc()
            self._phases(out, tokens)

    def _phases(self, out: RequestOutput, tokens: int) -> None:
        m, label = out.metrics, self.model_name
        arrival, scheduled, first, last = (m.get(k) for k in ("arrival_time", "first_scheduled_time",
                                                               "first_token_time", "last_token_time"))
        if scheduled is None:  # aborted while waiting
            return
        self.phases["queue"].labels(label).observe(max(0.0, scheduled - arrival))
        if first is None or last is None:  # aborted before its first token
            return
        for name, seconds in (("prefill", first - scheduled), ("decode", last - first),
                              ("inference", last - scheduled)):
            self.phases[name].labels(label).observe(max(0.0, seconds))
        # per token after the first of one of the n sequences (0 for one token, as vLLM observes it)
        per_seq = tokens // max(1, len(out.outputs))
        self.tpot.labels(label).observe(max(0.0, last - first) / (per_seq - 1) if per_seq > 1 else 0.0)

    def observe_params(self, n: int, max_tokens: int) -> None:
        """A finished request's n and the max_tokens in force for it."""
        self.n.labels(self.model_name).observe(n)
        self.max_tokens.labels(self.model_name).observe(max_tokens)


def _reason(reasons: set) -> Optional[str]:
    for r in ("abort", "length", "stop"):
        if r in reasons:
            return r
    return "stop"
