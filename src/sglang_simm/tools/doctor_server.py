"""``sglang-simm doctor --server URL``: why L3 does not hit, read from a running server.

Reads what a running SGLang server publishes, with the standard library
alone (``urllib``): ``/server_info``, ``/metrics`` where ``--enable-metrics``
is on, and ``GET /hicache/storage-backend`` where the server has an admin key
(a backend attached at runtime shows there). Where the server's L3 is a local
store of this host, the store's status and key namespaces are read too.

``analyse`` is pure (a server's dicts in, findings out); every finding names
the cause in plain words and the flag that changes it. A finding that
``blocks`` is one under which L3 cannot hit at all; any such makes the exit
status 1. The rules come from SGLang's own source (release noted at each).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from sglang_simm.config import SiMMConfig, client_flag, parse_client_flags
from sglang_simm.keys import WARMUP_KEY_PREFIX
from sglang_simm.local_store.admin import STORE_DIR_ENV, store_dir
from sglang_simm.tools.doctor import _reach, version_tuple

#: SGLang's default for the extra-config key ``prefetch_threshold`` (tokens)
DEFAULT_PREFETCH_THRESHOLD = 256
#: SGLang's defaults for ``prefetch_timeout_base`` (s) and ``prefetch_timeout_per_ki_token`` (s)
DEFAULT_TIMEOUT_BASE, DEFAULT_TIMEOUT_PER_KI = 1.0, 0.25
#: the last release whose prefetch capacity is ``max(0, 0.8 * (host - device))``
#: tokens (HiCacheController.attach_storage_backend); from 0.5.15 it is half the host pool
OLD_CAPACITY_RULE_UNTIL = (0, 5, 14)

#: the dynamic route's module of this backend
OUR_MODULE = "sglang_simm"


@dataclass
class Finding:
    #: "block" (L3 cannot hit), "warn" (hits fewer or later than meant), "info"
    level: str
    #: what is wrong, in plain words
    what: str
    #: the flag or setting that changes it
    fix: str = ""


@dataclass
class ServerView:
    url: str
    info: dict[str, Any] | None = None
    #: name -> [(labels, value)], None when /metrics is not served
    metrics: dict[str, list[tuple[dict[str, str], float]]] | None = None
    #: GET /hicache/storage-backend, None where it is not served or refused
    storage: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- reading


def _get(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read() or b""


def read_server(url: str, *, timeout_s: float = 10.0, api_key: str | None = None) -> ServerView:
    """Everything ``analyse`` reads from one server; what cannot be read is
    in ``errors`` (a server that does not answer at all: ``info`` None)."""
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    view = ServerView(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/server_info", "/get_server_info"):
        try:
            status, body = _get(url + path, timeout_s, headers)
        except (urllib.error.URLError, OSError) as exc:
            view.errors.append(f"{url} does not answer ({getattr(exc, 'reason', exc)})")
            return view
        if status == 200:
            view.info = json.loads(body)
            break
    else:
        if status in (401, 403):
            view.errors.append(
                f"{url} refuses /server_info (HTTP {status}): "
                + ("the API key given is not the server's" if api_key else
                   "the server was started with --api-key; pass it: doctor --server URL --api-key KEY")
            )
        else:
            view.errors.append(f"{url} serves neither /server_info nor /get_server_info (HTTP {status})")
        return view
    def optional(path: str, parse: Any) -> Any:  # None where not served, refused or unreadable
        try:
            status, body = _get(url + path, timeout_s, headers)
            return parse(body) if status == 200 else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    view.metrics = optional("/metrics", lambda body: parse_metrics(body.decode("utf-8", "replace")))
    view.storage = optional("/hicache/storage-backend", json.loads)
    return view


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text: sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_sum(metrics: dict[str, list[tuple[dict[str, str], float]]] | None, name: str, **match: str) -> float | None:
    """The sum of a sample's values over the label sets matching ``match``;
    None where no sample of that name exists."""
    if metrics is None or name not in metrics:
        return None
    return sum(v for labels, v in metrics[name] if all(labels.get(k) == want for k, want in match.items()))


# -------------------------------------------------------------- analysing


def extra_config_of(info: dict[str, Any], storage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The server's ``--hicache-storage-backend-extra-config`` as a dict (the
    runtime attachment's where one is known); {} where it cannot be read."""
    raw = (storage or {}).get("hicache_storage_backend_extra_config") or info.get("hicache_storage_backend_extra_config")
    if isinstance(raw, dict):
        return dict(raw)
    if not raw:
        return {}
    text = str(raw)
    try:
        if text.startswith("@"):  # a file of the server's host: read where doctor runs beside it
            with open(text[1:], encoding="utf-8") as fh:
                text = fh.read()
            if not text.lstrip().startswith("{"):
                import yaml  # SGLang depends on PyYAML (JSON is YAML too)

                data = yaml.safe_load(text)
                return data if isinstance(data, dict) else {}
        data = json.loads(text)
    except Exception:  # a TOML file, an unreadable path: the fields' defaults then
        return {}
    return data if isinstance(data, dict) else {}


def is_ours(backend: str | None, extra: dict[str, Any]) -> bool | None:
    """True: this plugin serves L3; False: another backend; None: ``simm``,
    which is this plugin where it is installed in the server's environment
    and SGLang's in-tree HiCacheSiMM otherwise."""
    if backend == "dynamic":
        return str(extra.get("module_path", "")).split(".")[0] == OUR_MODULE
    if backend == "simm":
        return None
    return False


def analyse(info: dict[str, Any], metrics: dict[str, Any] | None = None, storage: dict[str, Any] | None = None) -> list[Finding]:
    """Every reason this server's L3 cannot or does not hit that its
    ``/server_info``, ``/metrics`` and ``/hicache/storage-backend`` show."""
    out: list[Finding] = []
    version = version_tuple(info.get("version"))
    if not info.get("enable_hierarchical_cache"):
        out.append(Finding("block", "HiCache is off: the server has no host tier and no L3 tier",
                           "--enable-hierarchical-cache --hicache-storage-backend simm"))
        return out
    backend = (storage or {}).get("hicache_storage_backend", info.get("hicache_storage_backend"))
    extra = extra_config_of(info, storage)
    if not backend:
        out.append(Finding("block", "no L3 storage backend is attached: HiCache keeps pages in GPU and host "
                           "memory only", "--hicache-storage-backend simm --hicache-storage-backend-extra-config "
                           "'{\"manager_address\": ...}' (or PUT /hicache/storage-backend at runtime)"))
        return out
    ours = is_ours(backend, extra)
    if ours is False:
        what = (f"L3 is SGLang's {backend!r} backend, not sglang-simm" if backend != "dynamic" else
                f"L3 is the dynamic backend {extra.get('module_path')}.{extra.get('class_name')}, not sglang-simm")
        out.append(Finding("block", what, "--hicache-storage-backend simm (or dynamic with "
                           "\"module_path\": \"sglang_simm\", \"class_name\": \"HiCacheSiMM\")"))
    if backend == "dynamic" and ours and not extra.get("interface_v1"):
        out.append(Finding("warn", "the dynamic route without interface_v1: SGLang copies every page through "
                           "Python (its slow copying path)", "add \"interface_v1\": 1 to the extra config, or use "
                           "--hicache-storage-backend simm"))
    ours_in_metrics = metrics is not None and any(n.startswith("sglang_simm:l3_") for n in metrics)
    if backend == "simm" and metrics is not None and not ours_in_metrics:
        out.append(Finding("warn", "--hicache-storage-backend simm is served by SGLang's in-tree HiCacheSiMM "
                           "here (its /metrics has no sglang_simm: series): sglang-simm is not installed in the "
                           "server's environment, or is older than its metrics",
                           "pip install sglang-simm into the server's environment"))

    policy = (storage or {}).get("hicache_write_policy") or info.get("hicache_write_policy")
    if policy == "write_back":
        out.append(Finding("warn", "write policy write_back: a page goes to host memory, and from there to L3, "
                           "only when the GPU pool evicts it; until the GPU pool fills, L3 receives nothing and "
                           "nothing can hit there", "--hicache-write-policy write_through"))
    elif policy == "write_through_selective":
        out.append(Finding("warn", "write policy write_through_selective: a prefix is backed up (to host, then "
                           "L3) only once it has been hit twice; a prefix served once never reaches L3",
                           "--hicache-write-policy write_through"))
    elif policy is not None:  # None: not published
        out.append(Finding("info", f"write policy {policy}: every computed prefix is written to host memory "
                           "and then to L3 as it is computed"))

    prefetch = (storage or {}).get("hicache_storage_prefetch_policy") or info.get("hicache_storage_prefetch_policy")
    base = float(extra.get("prefetch_timeout_base", DEFAULT_TIMEOUT_BASE))
    per_ki = float(extra.get("prefetch_timeout_per_ki_token", DEFAULT_TIMEOUT_PER_KI))
    if prefetch == "best_effort":
        out.append(Finding("warn", "prefetch policy best_effort: a read from L3 stops as soon as the scheduler "
                           "takes the request, so on a server with free capacity most L3 reads are cut short "
                           "and recomputed", "--hicache-storage-prefetch-policy timeout"))
    elif prefetch == "timeout":
        level = "warn" if base < 0.1 else "info"
        out.append(Finding(level, f"prefetch policy timeout: an L3 read may hold a request for {base:g} s plus "
                           f"{per_ki:g} s per 1024 tokens; a slower read is cut short",
                           "prefetch_timeout_base / prefetch_timeout_per_ki_token in the extra config"))
    elif prefetch == "wait_complete":
        out.append(Finding("info", "prefetch policy wait_complete: a request waits for its whole L3 read"))

    page = int(info.get("page_size") or 1)
    threshold = max(int(extra.get("prefetch_threshold", DEFAULT_PREFETCH_THRESHOLD)), page)
    prompts = metric_sum(metrics, "sglang:prompt_tokens_total")
    requests = metric_sum(metrics, "sglang:num_requests_total")
    mean = prompts / requests if prompts is not None and requests else None
    if mean is not None and mean < threshold:
        out.append(Finding("block", f"the prefetch threshold is {threshold} tokens and the prompts served so far "
                           f"average {mean:.0f}: SGLang asks L3 only for the part of a prompt not already in GPU "
                           f"or host memory, and only when it is at least {threshold} tokens long",
                           "\"prefetch_threshold\": N in --hicache-storage-backend-extra-config"))
    else:
        below = metric_sum(metrics, "sglang:storage_prefetch_unfulfilled_tokens_total", reason="below_threshold")
        note = f" ({below:.0f} tokens were skipped for it so far)" if below else ""
        out.append(Finding("warn" if below else "info", f"prefetch threshold {threshold} tokens: a prompt whose "
                           f"uncached part is shorter never reads L3{note}",
                           "\"prefetch_threshold\": N in --hicache-storage-backend-extra-config"))

    out += _capacity(info, version)

    if not info.get("enable_metrics"):
        out.append(Finding("warn", "SGLang's metrics are off: no /metrics, so neither SGLang's L3 counters nor "
                           "sglang-simm's (hits, misses, faults, latency) can be read", "--enable-metrics"))
    elif metrics is not None:
        out += _from_metrics(metrics)
    return out


def _capacity(info: dict[str, Any], version: tuple[int, ...]) -> list[Finding]:
    """SGLang's prefetch capacity (HiCacheController.attach_storage_backend):
    up to 0.5.14 ``max(0, int(0.8 * (host - device)))`` tokens, zero at
    ``--hicache-ratio`` 1.0 or less, and then every prefetch is rate-limited
    (``prefetch_rate_limited``); from 0.5.15 half the host pool."""
    device = info.get("max_total_num_tokens")
    ratio = info.get("hicache_ratio")
    size_gb = info.get("hicache_size") or 0
    if not version or version > OLD_CAPACITY_RULE_UNTIL or device is None:
        return []
    if size_gb:
        return [Finding("info", f"host pool set by --hicache-size {size_gb} GB: SGLang {'.'.join(map(str, version))} "
                        "allows prefetches of 0.8 x (host - device) tokens, which is zero where the host pool "
                        "holds no more tokens than the GPU pool", "--hicache-size larger than the GPU pool")]
    if ratio is None:
        return []
    host = int(int(device) * float(ratio))
    capacity = max(0, int(0.8 * (host - int(device))))
    if capacity <= 0:
        return [Finding("block", f"--hicache-ratio {ratio:g}: SGLang {'.'.join(map(str, version))} allows "
                        f"prefetches of 0.8 x (host - device) = 0.8 x ({host} - {device}) tokens, which is 0, so "
                        "every L3 read is rate-limited away (sgl-project/sglang#26449)",
                        "--hicache-ratio 2 (or more), or SGLang 0.5.15+")]
    return [Finding("info", f"prefetch capacity 0.8 x (host - device) = {capacity} tokens")]


def _from_metrics(metrics: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    hit = metric_sum(metrics, "sglang_simm:l3_pages_hit_total")
    missed = metric_sum(metrics, "sglang_simm:l3_pages_missed_total")
    written = metric_sum(metrics, "sglang_simm:l3_pages_written_total")
    if hit is not None or written is not None:
        out.append(Finding("info", f"sglang-simm: {hit or 0:.0f} pages hit, {missed or 0:.0f} missed, "
                           f"{written or 0:.0f} written"))
    faults = metrics.get("sglang_simm:l3_faults_total") or []
    by_code: dict[str, float] = {}
    for labels, v in faults:
        by_code[labels.get("code", "?")] = by_code.get(labels.get("code", "?"), 0) + v
    if any(by_code.values()):
        text = ", ".join(f"{c} x{n:.0f}" for c, n in sorted(by_code.items()) if n)
        out.append(Finding("warn", f"L3 calls failed: {text} (each answered as a miss)",
                           "see docs/keys-and-faults.md for each code"))
    state = metric_sum(metrics, "sglang_simm:breaker_state")
    if state and state >= 2:
        out.append(Finding("block", "the circuit breaker is open: L3 calls are skipped until the store answers "
                           "again", "the store (see the faults above); the breaker closes by itself"))
    storage_hits = metric_sum(metrics, "sglang:cached_tokens_total", cache_source="storage")
    if storage_hits is not None:
        out.append(Finding("info", f"SGLang counts {storage_hits:.0f} prompt tokens served from L3"))
    return out


# ------------------------------------------------------------ the store


def store_of(extra: dict[str, Any]) -> tuple[str, str] | None:
    """(store directory, name) of a local store named by the extra config's
    manager address; None for a cluster."""
    try:
        config = SiMMConfig(manager_address=extra.get("manager_address", ""))
    except (ValueError, TypeError):
        return None
    if config.local_store_scope != "host":
        return None
    return store_dir(client_flag(extra, "local_store_dir")), config.local_store_name


#: a namespaced key's prefix: optional tag, then s<version>.<16 hex>/
_NAMESPACE = re.compile(r"^(?:(.*?)/)?(s\d+\.[0-9a-f]{16})/")


def namespaces(keys: list[str]) -> dict[str, int]:
    """Objects per key namespace (``tag/s1.<fingerprint>``, ``legacy`` for
    others); start-up round trips left out."""
    out: dict[str, int] = {}
    for key in keys:
        if key.startswith((WARMUP_KEY_PREFIX, "sglang_simm_doctor_")):
            continue
        m = _NAMESPACE.match(key)
        name = (f"{m.group(1)}/" if m.group(1) else "") + m.group(2) if m else "legacy (no namespace)"
        out[name] = out.get(name, 0) + 1
    return out


def reported_store(metrics: dict[str, Any] | None) -> tuple[str, str] | None:
    """The local store's directory, and what chose it, as the server's
    backend reports it (``sglang_simm:l3_store_info``); None where it is not
    reported (metrics off, a cluster, a plugin older than the series)."""
    for labels, _value in (metrics or {}).get("sglang_simm:l3_store_info", []):
        if labels.get("store_dir"):
            return labels["store_dir"], labels.get("store_dir_from", "")
    return None


def _why_apart(server_dir: str, chosen_by: str, shell_dir: str | None) -> str:
    """The likely cause of a server keeping its local store where this
    shell would not look (``chosen_by``: what chose the server's)."""
    shell = f"this shell sets it to {shell_dir}" if shell_dir else "this shell lacks it"
    if chosen_by.startswith("env "):
        variable = chosen_by[len("env "):]
        return f"the server's environment sets {variable}={server_dir} and {shell}"
    if chosen_by == "default" and shell_dir:
        return f"the server uses the default directory, and this shell sets {STORE_DIR_ENV}={shell_dir}"
    if chosen_by == "default":  # the default names the user: /dev/shm/sglang-simm-<uid>
        return "the server uses its user's default directory: it runs as another user"
    return (f"the server's {chosen_by} names it (from its environment or config file, which this shell does "
            "not share)")


def server_l3_works(metrics: dict[str, Any] | None) -> str | None:
    """What the server's own counters show of an L3 that works (pages hit
    or written, the breaker not open), in words; None where they show none."""
    hit = metric_sum(metrics, "sglang_simm:l3_pages_hit_total") or 0
    written = metric_sum(metrics, "sglang_simm:l3_pages_written_total") or 0
    faults = metric_sum(metrics, "sglang_simm:l3_faults_total") or 0
    if (metric_sum(metrics, "sglang_simm:breaker_state") or 0) >= 2 or not (hit or written):
        return None
    return f"{hit:.0f} pages hit and {written:.0f} written, {faults:.0f} faults"


def reconcile_store(name: str, looked_in: str, reported: tuple[str, str] | None, status: dict[str, Any],
                    keys: list[str] | None, metrics: dict[str, Any] | None,
                    shell_dir: str | None) -> list[Finding]:
    """The local store's findings: ``status`` describes the store in the
    directory the server reports (``reported``), else in the one doctor's
    sources name (``looked_in``). Where doctor cannot reach it and the
    server's counters show L3 at work, the server's view wins, and the
    finding says where the two differ and why, most likely."""
    out: list[Finding] = []
    if reported is not None and reported[0] != looked_in:
        out.append(Finding("warn", f"the server's local store {name!r} lives in {reported[0]}, as the server "
                           f"reports, not in {looked_in}, where this shell would look: "
                           f"{_why_apart(reported[0], reported[1], shell_dir)}; doctor reads the server's",
                           f"{STORE_DIR_ENV}={reported[0]} in this shell, for sglang-simm store commands on it"))
    found = analyse_store(status, keys)
    works = server_l3_works(metrics)
    if status.get("running") or works is None:
        if not status.get("running") and reported is None:
            found[0].what += (f"; doctor looked in {looked_in}, and a server started with {STORE_DIR_ENV} set "
                              "elsewhere (or as another user, or in another container) keeps its store there: "
                              "--enable-metrics makes the server report where")
        return out + found
    where = reported[0] if reported is not None else looked_in
    if reported is None:
        cause = (f"the server's environment sets {STORE_DIR_ENV} elsewhere (this shell: "
                 f"{shell_dir or 'unset'}), or the server runs as another user or in another container")
    else:
        cause = "the server runs as another user, or in another container (its /dev/shm is not this shell's)"
    return out + [Finding("warn", f"doctor cannot reach the local store {name!r} in {where} from here "
                          f"({status.get('why', 'no answer')}), yet the server reports {works}: the store serves "
                          f"the server, and the server's figures win. Doctor's look differs, likely because {cause}",
                          "run doctor where the server runs (its user, its environment)")]


def analyse_store(status: dict[str, Any], keys: list[str] | None) -> list[Finding]:
    """A local store's status (``sglang-simm store status``) and keys."""
    name = status.get("name", "?")
    if not status.get("running"):
        return [Finding("block", f"the local store {name!r} is not running or does not answer "
                        f"({status.get('why', '')}): every L3 call fails", f"sglang-simm store start {name}, or "
                        "restart the server (its first scheduler starts the store)")]
    out: list[Finding] = []
    used, cap = int(status.get("used_bytes", 0)), int(status.get("capacity_bytes", 0) or 0)
    evictions = int(status.get("evictions", 0))
    if cap and used >= 0.9 * cap and evictions:
        out.append(Finding("warn", f"the local store {name!r} is full ({used / cap:.0%} of {cap >> 20} MiB) "
                           f"and has evicted {evictions} objects: older prefixes are gone before they are "
                           "asked for again", "\"local_store_capacity_bytes\" in the extra config (then "
                           f"sglang-simm store stop {name}), or sglang-simm store start {name} --capacity ..."))
    if keys is not None:
        spaces = namespaces(keys)
        if len(spaces) > 1:
            listing = ", ".join(f"{n} ({c} objects)" for n, c in sorted(spaces.items(), key=lambda x: -x[1]))
            out.append(Finding("warn", f"the local store {name!r} holds pages under {len(spaces)} key namespaces: "
                               f"{listing}. Servers in different namespaces (model, TP, page size, dtype, "
                               "layout or extra_backend_tag differ) never read each other's pages",
                               "the same model, --tp-size, --page-size, --kv-cache-dtype, --hicache-mem-layout "
                               "and extra_backend_tag on servers that should share"))
        elif spaces:
            ((n, c),) = spaces.items()
            out.append(Finding("info", f"the local store {name!r} holds {c} objects under one namespace, {n}"))
    return out


#: server_info fields that go into a page's key namespace
NAMESPACE_FIELDS = ("model_path", "served_model_name", "tp_size", "pp_size", "page_size", "kv_cache_dtype",
                    "hicache_mem_layout", "dtype")


def _store_dir_flag(extra: dict[str, Any]) -> str:
    """The client flag ``local_store_dir`` (or its old name) of a server's
    extra config, "" when unset or unreadable; nothing logged."""
    try:
        return parse_client_flags(extra.get("client_flags"), warn=False).get("local_store_dir", "")
    except ValueError:
        return ""


def compare_namespaces(views: list[tuple[str, dict[str, Any]]]) -> list[Finding]:
    """Servers on the same store whose pages are named apart."""
    out: list[Finding] = []
    by_store: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for url, info in views:
        extra = extra_config_of(info)
        where = f"{extra.get('manager_address', '')}|{_store_dir_flag(extra)}"
        by_store.setdefault(where, []).append((url, {**info, "extra_backend_tag": extra.get("extra_backend_tag"),
                                                     "key_scheme": extra.get("key_scheme", "namespaced")}))
    for where, group in by_store.items():
        if len(group) < 2:
            continue
        fields = (*NAMESPACE_FIELDS, "extra_backend_tag", "key_scheme")
        differ = [f for f in fields if len({json.dumps(i.get(f), sort_keys=True) for _, i in group}) > 1]
        if differ:
            text = "; ".join(f"{f}: " + ", ".join(f"{u} {i.get(f)!r}" for u, i in group) for f in differ)
            out.append(Finding("warn", f"servers on the store {where.split('|')[0]!r} name their pages apart, so "
                               f"none reads another's: {text}", "the same value on every server that should share"))
    return out


# --------------------------------------------------------------- printing


def run_doctor_server(console: Any, urls: list[str], *, api_key: str | None = None, timeout_s: float = 10.0) -> int:
    from rich.markup import escape

    blocked = 0
    seen: list[tuple[str, dict[str, Any]]] = []
    for url in urls:
        view = read_server(url, timeout_s=timeout_s, api_key=api_key)
        console.print(f"[bold]{escape(view.url)}[/bold]")
        findings: list[Finding] = []
        if view.info is None:
            findings.append(Finding("block", "; ".join(view.errors) or "no answer", "the server's URL (--server)"))
        else:
            info = view.info
            console.print(escape(f"SGLang {info.get('version', '?')}, model {info.get('served_model_name') or info.get('model_path')}, "
                                 f"page size {info.get('page_size')}, GPU pool {info.get('max_total_num_tokens')} tokens, "
                                 f"/metrics {'read' if view.metrics is not None else 'not served'}, "
                                 f"/hicache/storage-backend {'read' if view.storage is not None else 'not served (needs --admin-api-key)'}"),
                          soft_wrap=True)
            seen.append((view.url, info))
            findings += analyse(info, view.metrics, view.storage)
            extra = extra_config_of(info, view.storage)
            backend = (view.storage or {}).get("hicache_storage_backend", info.get("hicache_storage_backend"))
            if info.get("enable_hierarchical_cache") and backend and is_ours(backend, extra) is not False:
                findings += _store_findings(extra, view.metrics)
        for f in findings:
            style = {"block": "red", "warn": "yellow", "info": "dim"}[f.level]
            word = {"block": "blocks hits", "warn": "warning", "info": "note"}[f.level]
            fix = f" [bold]Change:[/bold] {escape(f.fix)}" if f.fix and f.level != "info" else ""
            console.print(f"[{style}]{word}:[/{style}] {escape(f.what)}.{fix}", soft_wrap=True)
        blocked += sum(f.level == "block" for f in findings)
        console.print()
    for f in compare_namespaces(seen):
        console.print(f"[yellow]warning:[/yellow] {escape(f.what)}. [bold]Change:[/bold] {escape(f.fix)}", soft_wrap=True)
    if blocked:
        console.print(f"[red]{blocked} cause(s) above keep L3 from hitting.[/red]")
        return 1
    console.print("[green]Nothing found that keeps L3 from hitting.[/green]")
    return 0


def _store_findings(extra: dict[str, Any], metrics: dict[str, Any] | None = None) -> list[Finding]:
    """The local store's findings (in the directory the server reports,
    where it does), or a cluster manager's reachability."""
    where = store_of(extra)
    if where is None:
        try:
            config = SiMMConfig(manager_address=extra.get("manager_address", ""))
        except (ValueError, TypeError) as exc:
            return [Finding("block", f"the extra config's manager_address is not valid ({exc})",
                            "\"manager_address\": \"host:port\" or \"local\"")]
        if not config.host:
            return []
        why = _reach(config.host, config.port)
        if why is None:
            return [Finding("info", f"the cluster manager {config.host}:{config.port} accepts TCP connections")]
        return [Finding("block", f"the cluster manager {config.host}:{config.port} is unreachable from here ({why})",
                        "manager_address, the manager process, the firewall")]
    looked_in, name = where
    from sglang_simm.local_store.admin import StoreUnreachable, open_running
    from sglang_simm.tools.store import _status_of

    reported = reported_store(metrics)
    root = reported[0] if reported is not None else looked_in
    status = _status_of(root, name)
    keys = None
    if status.get("running"):
        try:
            handle = open_running(root, name)
            try:
                keys = handle.keys()
            finally:
                handle.close()
        except (StoreUnreachable, ValueError):
            keys = None
    return reconcile_store(name, looked_in, reported, status, keys, metrics, os.environ.get(STORE_DIR_ENV))
