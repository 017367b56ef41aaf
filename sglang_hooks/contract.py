"""What the plugin relies on in SGLang's source, checked by parsing it (never importing).

The hooks patch nine targets (four in the scheduler, SGLang's adaptive policy class, and
the off switch's four in the EAGLE worker) and read a handful of attributes. SGLang's
scheduler and EAGLE worker modules cannot be imported without a GPU stack, so
the plugin (at load) and the contract test (for every pinned version) verify
them with :mod:`ast` on the installed source instead:

* :func:`target_problems` -- the hook targets exist with the expected
  parameters (what :func:`sglang_hooks.plugin.register` checks before patching);
* :func:`contract_problems` -- that, plus every attribute the hooks read and the
  call paths the design depends on (what ``tests/test_sglang_contract.py`` checks);
* :func:`append_only_problems` -- that no code changes a batch's request list in place
  except by appending (:data:`APPEND_ONLY`, which the recorder relies on). The contract
  test checks it for every pinned version; the plugin does not at load: it parses ~90
  of SGLang's modules, 1.2-1.4 s of CPU (measured here) in every scheduler process's
  start-up, where the rest of the contract takes 0.3 s.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SCHEDULER = "sglang.srt.managers.scheduler"
RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver"
PARAMS = "sglang.srt.speculative.adaptive_spec_params"
RUNTIME_STATE = "sglang.srt.speculative.adaptive_runtime_state"
BATCH = "sglang.srt.managers.schedule_batch"
RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"
EAGLE = "sglang.srt.speculative.eagle_worker_v2"
FORWARD = "sglang.srt.model_executor.forward_batch_info"
ALLOCATOR = "sglang.srt.mem_cache.allocator.base"
PREFIX_CACHE = "sglang.srt.mem_cache.base_prefix_cache"
TP_WORKER = "sglang.srt.managers.tp_worker"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
ENGINE = "sglang.srt.entrypoints.engine"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
WARMUP = "sglang.srt.entrypoints.warmup"
LAUNCH_SERVER = "sglang.launch_server"
CLI_SERVE = "sglang.cli.serve"
IO_STRUCT = "sglang.srt.managers.io_struct"


@dataclass(frozen=True)
class Method:
    """``cls.name`` is defined in ``module`` and its parameters start with ``params``."""

    module: str
    cls: str
    name: str
    params: tuple[str, ...]

    @property
    def target(self) -> str:
        return f"{self.module}.{self.cls}.{self.name}"


@dataclass(frozen=True)
class Attributes:
    """Each ``self.<name>`` is assigned in some method of ``cls`` (or is a class field)."""

    module: str
    cls: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Calls:
    """The function's source (normalised by ``ast.unparse``) contains each snippet."""

    module: str
    function: str  # "Class.method" or "function"
    snippets: tuple[str, ...]


@dataclass(frozen=True)
class AppendOnly:
    """No module under ``package`` changes a ``.<attr>`` list in place except by appending
    to it (``append``, ``extend``, ``+=``); rebinding the attribute to a new list is fine.

    Checked in every function: calls of the list's other mutating methods, item and slice
    assignment and deletion, other augmented assignments; on ``X.<attr>`` itself and on
    the names bound to such a list in that function (``reqs = batch.reqs``, a name stored
    into ``X.<attr>``, passed as ``<attr>=`` or as the first argument of ``init_new``).
    Not followed: a list handed to another function that changes its parameter (none of
    the pinned trees' functions that receive ``.reqs`` does).
    """

    package: str
    attr: str


#: The recorder reads a step's request lists on its own thread, later, by reference: their
#: first entries (as many as the batch had) must still be the batch's requests then.
APPEND_ONLY = AppendOnly("sglang.srt", "reqs")
#: List methods that change a list other than at its end.
_REORDERING = frozenset({"insert", "pop", "remove", "clear", "sort", "reverse",
                         "__setitem__", "__delitem__", "__imul__"})

#: The scheduler's hook targets (the same in every supported version).
HOOK_TARGETS = (
    Method(RECEIVER, "SchedulerRequestReceiver", "_pull_raw_reqs", ("self",)),
    Method(SCHEDULER, "Scheduler", "process_input_requests", ("self", "recv_reqs")),
    Method(SCHEDULER, "Scheduler", "run_batch", ("self", "batch")),
    Method(SCHEDULER, "Scheduler", "process_batch_result", ("self", "batch", "result")),
)
POLICY_CLASS = f"{PARAMS}.AdaptiveSpeculativeParams"

#: The off switch's hook targets (:mod:`sglang_hooks.offswitch`; the same in every version).
OFF_SWITCH_TARGETS = (
    Method(EAGLE, "EAGLEWorkerV2", "init_cuda_graphs", ("self",)),
    Method(EAGLE, "EAGLEWorkerV2", "verify", ("self", "batch")),
    Method(TP_WORKER, "TpModelWorker", "forward_batch_generation",
           ("self", "batch", "forward_batch", "pp_proxy_tensors", "is_verify")),
    Method(EAGLE, "EagleDraftWorker", "_draft_extend_for_decode",
           ("self", "batch", "batch_result")),
    Method(EAGLE, "EagleDraftWorker", "_draft_extend_for_prefill",
           ("self", "batch", "target_hidden_states", "next_token_ids")),
)

#: What the off path builds and reads besides its hook targets.
_OFF_SWITCH = (
    *OFF_SWITCH_TARGETS,
    Method(EAGLE, "EAGLEWorkerV2", "_stub_skipped_draft_extend", ("self", "batch", "batch_output")),
    Method(EAGLE, "EAGLEWorkerV2", "_build_trivial_verify_input", ("self", "batch")),
    # A prefill while off: the stub draft input is this dataclass, built by keyword.
    Attributes("sglang.srt.speculative.eagle_info", "EagleDraftInput",
               ("bonus_tokens", "num_tokens_per_req", "num_tokens_for_logprob_per_req")),
    # steps=0 builds the one-token verify input and runs the draft extend we skip.
    Calls(EAGLE, "EAGLEWorkerV2.forward_batch_generation", (
        "verify_input = self._build_trivial_verify_input(batch)",
        "self.draft_worker._draft_extend_for_decode(",
    )),
    # Verify plans its graph only through the model runner's decode graph runner, which
    # the off step hides (a None runner is SGLang's own non-graph route).
    Calls("sglang.srt.speculative.eagle_utils", "eagle_prepare_for_verify", (
        "target_worker.model_runner.decode_cuda_graph_runner and "
        "target_worker.model_runner.decode_cuda_graph_runner.can_run_graph(",
    )),
    Method(MODEL_RUNNER, "ModelRunner", "_get_attention_backend", ("self", "init_new_workspace")),
    Attributes(MODEL_RUNNER, "ModelRunner", (
        "decode_cuda_graph_runner", "attn_backend", "spec_algorithm", "init_new_workspace")),
    # Graphs are captured in DECODE mode unless the model runner is speculative.
    Method(GRAPH_RUNNER, "DecodeCudaGraphRunner", "__init__", ("self", "model_runner")),
    Calls(GRAPH_RUNNER, "DecodeCudaGraphRunner.__init__", (
        "self.capture_forward_mode = ForwardMode.DECODE",
        "if model_runner.spec_algorithm.is_speculative():",
    )),
    Attributes(GRAPH_RUNNER, "DecodeCudaGraphRunner", ("capture_bs",)),
    Attributes(FORWARD, "ForwardBatch", (
        "forward_mode", "global_forward_mode", "positions", "seq_lens", "orig_seq_lens",
        "seq_lens_cpu", "seq_lens_sum", "spec_info", "spec_algorithm", "capture_hidden_mode",
        "forward_metadata_ready", "batch_size",
    )),
)

_COMMON = (
    *HOOK_TARGETS,
    Method(PARAMS, "AdaptiveSpeculativeParams", "__init__", ("self", "initial_steps", "cfg_path")),
    Method(PARAMS, "AdaptiveSpeculativeParams", "get_steps_for_batch", ("self", "batch_size")),
    Method(PARAMS, "AdaptiveSpeculativeParams", "on_verify_complete",
           ("self", "num_correct_drafts_per_req", "batch_size")),
    Method(PARAMS, "AdaptiveSpeculativeParams", "candidate_steps", ("self",)),
    Method(PARAMS, "AdaptiveSpeculativeParams", "_route", ("self", "batch_size")),
    Attributes(PARAMS, "AdaptiveSpeculativeParams", ("_slots",)),
    Attributes(PARAMS, "AdaptiveStepSlot", ("candidate_steps", "current_steps")),
    Method(RUNTIME_STATE, "AdaptiveController", "activate_step_by_batch", ("self", "batch_size")),
    Calls(RUNTIME_STATE, "AdaptiveController.activate_step_by_batch",
          ("self.params.get_steps_for_batch(batch_size)",)),
    Calls(RUNTIME_STATE, "AdaptiveController.on_verify_complete",
          ("self.params.on_verify_complete(num_correct_drafts_per_req, batch_size)",
           "if new_step is not None:")),
    # The decision marker rides the request list from the source rank's pull,
    # through the TP broadcast, into process_input_requests on every rank.
    Calls(RECEIVER, "SchedulerRequestReceiver.recv_requests",
          ("recv_reqs = self._pull_raw_reqs()", "self._broadcast_reqs_across_ranks(recv_reqs")),
    Calls(RECEIVER, "SchedulerRequestReceiver._broadcast_reqs_across_ranks",
          ("broadcast_pyobj(recv_reqs,",)),
    # Step index: forward_ct, copied to the batch and to its result-processing copy.
    Attributes(SCHEDULER, "Scheduler", (
        "forward_ct", "waiting_queue", "running_batch", "token_to_kv_pool_allocator",
        "tree_cache", "max_total_num_tokens", "server_args",
    )),
    Calls(SCHEDULER, "Scheduler.run_batch",
          ("self.forward_ct += 1", "batch.forward_iter = self.forward_ct")),
    Calls(SCHEDULER, "Scheduler.event_loop_overlap",
          ("batch_result = self.run_batch(batch)",
           "self.process_batch_result(tmp_batch, tmp_result)")),
    Attributes(BATCH, "ScheduleBatch",
               ("reqs", "forward_mode", "extend_num_tokens", "forward_iter", "prefix_lens",
                "extend_lens")),
    Calls(BATCH, "ScheduleBatch.copy", ("forward_iter=self.forward_iter",)),
    Attributes(BATCH, "Req", ("rid", "origin_input_ids", "output_ids", "finished_reason")),
    Method(FORWARD, "ForwardMode", "is_decode", ("self",)),
    Method(FORWARD, "ForwardMode", "is_extend", ("self",)),
    Method(ALLOCATOR, "BaseTokenToKVPoolAllocator", "available_size", ("self",)),
    Method(PREFIX_CACHE, "BasePrefixCache", "evictable_size", ("self",)),
    # Acceptance reaches the policy on the scheduler thread, per processed batch.
    Calls(RESULTS, "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
          ("self.model_worker.on_verify_complete_cpu(result.num_correct_drafts_per_req_cpu, "
           "batch_size=len(batch.reqs))",)),
    Calls(EAGLE, "EAGLEWorkerV2.forward_batch_generation",
          ("self.activate_step_by_batch(batch.seq_lens.shape[0])",)),
    Calls(EAGLE, "EAGLEWorkerV2.on_verify_complete_cpu",
          ("self.adaptive_controller.on_verify_complete(",)),
    # Hooks register only in scheduler processes, recognised by this caller.
    Calls(SCHEDULER, "run_scheduler_process", ("load_plugins()",)),
    # Every switch logs this line (the plugin filters it: see sglang_hooks.switching).
    Calls(EAGLE, "EAGLEWorkerV2.apply_runtime_state", ("Switch adaptive runtime state",)),
    # The fallback uses SGLang's default tiers: the constructor without a config file.
    Calls(PARAMS, "_load_adaptive_config", ("cfg = DEFAULT_ADAPTIVE_CONFIG",)),
    *_OFF_SWITCH,
)

#: The start-up warm-up (:mod:`sglang_hooks.warmup`), the same in every supported version.
#: Checked by the contract test, not at load: it parses the engine and the HTTP server
#: (~7,000 lines), which only the HTTP process would need, and that process registers the
#: warm-up only if SGLang's registry imports and has the ``warmup`` decorator.
WARMUP_CONTRACT = (
    # The main process's loader calls come from the engine (compat.in_http_process).
    Calls(ENGINE, "Engine.__init__", ("load_plugins()",)),
    Calls(ENGINE, "Engine._launch_subprocesses", ("load_plugins()",)),
    # ... or first from `sglang serve` (and `python -m sglang.launch_server`, whose call is
    # module-level code under `if __name__ == "__main__"`, which Calls cannot name).
    Calls(CLI_SERVE, "serve", ("load_plugins()",)),
    # The registry and how SGLang runs a warm-up: awaited with these two arguments.
    Calls(WARMUP, "warmup", ("_warmup_registry[name] = fn",)),
    Calls(WARMUP, "execute_warmups", (
        "await _warmup_registry[warmup_name](disaggregation_mode, tokenizer_manager)",)),
    # ... at start-up, before the server takes requests (the lifespan's yield).
    Calls(HTTP_SERVER, "lifespan", ("await execute_warmups(", ".warmups.split(',')", "yield")),
    Method("sglang.srt.managers.tokenizer_manager", "TokenizerManager", "generate_request",
           ("self", "obj", "request")),
    Attributes("sglang.srt.managers.tokenizer_manager", "TokenizerManager",
               ("server_args", "model_config")),
    Attributes(IO_STRUCT, "GenerateReqInput", ("input_ids", "rid", "sampling_params", "stream")),
    Attributes("sglang.srt.sampling.sampling_params", "SamplingParams",
               ("max_new_tokens", "ignore_eos", "temperature")),
    # The scheduler sees the tokenizer's request id, unchanged, on what it receives (the
    # id is a field of the base class of every single-request message).
    Attributes(IO_STRUCT, "BaseReq", ("rid",)),
    Calls(IO_STRUCT, "TokenizedGenerateReqInput", ("class TokenizedGenerateReqInput(BaseReq,",)),
    Attributes(IO_STRUCT, "TokenizedGenerateReqInput", ("input_ids",)),
    Attributes(IO_STRUCT, "BatchTokenizedGenerateReqInput", ("batch",)),
)

#: Per supported version: everything above plus how ranks are read and who
#: constructs the policy.
CONTRACTS: dict[str, tuple] = {
    "0.5.15.post1": (
        *_COMMON,
        Attributes(SCHEDULER, "Scheduler", ("ps",)),
        Attributes("sglang.srt.distributed.parallel_state_wrapper", "ParallelState",
                   ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank")),
        Calls(SCHEDULER, "Scheduler.event_loop_overlap",
              ("recv_reqs = self.request_receiver.recv_requests()",
               "self.process_input_requests(recv_reqs)")),
        Calls(RUNTIME_STATE, "AdaptiveController.__init__",
              ("AdaptiveSpeculativeParams(initial_steps=worker.speculative_num_steps, "
               "cfg_path=config_path)",)),
        Calls(EAGLE, "EAGLEWorkerV2.__init__", ("AdaptiveController(self, config_path=",)),
        Attributes(EAGLE, "EAGLEWorkerV2", ("target_worker",)),
        Calls(EAGLE, "EAGLEWorkerV2.verify", (
            "self.target_worker.forward_batch_generation(batch=None, "
            "forward_batch=verify_forward_batch, is_verify=True)",)),

        # A prefill runs the draft's extend over the prompt, which a prefill while off skips.
        Calls(EAGLE, "EAGLEWorkerV2.forward_batch_generation",
              ("self.draft_worker._draft_extend_for_prefill(",)),
    ),
    "0.5.23": (
        *_COMMON,
        Attributes("sglang.srt.arg_groups.fields.parallel", "Parallel",
                   ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "attn_dp_enabled")),
        Calls("sglang.srt.runtime_context", "get_parallel", ("return",)),
        Calls(SCHEDULER, "Scheduler.event_loop_overlap", ("self.ingest_requests()",)),
        Calls(SCHEDULER, "Scheduler.ingest_requests",
              ("self.request_receiver.recv_requests(", "self.process_input_requests(recv_reqs)")),
        Calls(EAGLE, "EAGLEWorkerV2.__init__",
              ("AdaptiveController(self, AdaptiveSpeculativeParams(initial_steps=",)),
        Method("sglang.srt.speculative.base_spec_worker", "BaseSpecWorker", "target_worker",
               ("self",)),
        # A prefill runs the draft's extend over the prompt, which a prefill while off skips.
        Calls(EAGLE, "EAGLEWorkerV2._forward_prefill_batch",
              ("self.draft_worker._draft_extend_for_prefill(",)),
        Calls("sglang.srt.speculative.eagle_worker_common", "run_eagle_verify", (
            "target_worker.forward_batch_generation(batch=None, "
            "forward_batch=verify_forward_batch, is_verify=True,",)),
        # Every switch appends to the process's overrides log (the plugin keeps it bounded).
        Calls(EAGLE, "EAGLEWorkerV2.apply_runtime_state",
              ("get_context().override('adaptive_spec.restore'",)),
        Calls("sglang.srt.runtime_context", "RuntimeContext.override",
              ("self._overrides_log.append((source, dict(fields)))",)),
    ),
}


class SourceTree:
    """Parsed modules of one installed SGLang (``root`` holds the ``sglang`` package)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            path = self.root.joinpath(*name.split(".")).with_suffix(".py")
            try:
                self._trees[name] = ast.parse(path.read_text(), str(path))
            except (OSError, SyntaxError, ValueError):
                self._trees[name] = None
        return self._trees[name]

    def find(self, module: str, dotted: str) -> ast.AST | None:
        """A top-level class/function, or a ``Class.method``."""
        node: ast.AST | None = self.module(module)
        for part in dotted.split("."):
            if node is None:
                return None
            node = next(
                (
                    child for child in ast.iter_child_nodes(node)
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and child.name == part
                ),
                None,
            )
        return node


def target_problems(root: str | Path) -> list[str]:
    """Problems with the hook targets in the SGLang installed under ``root`` (empty: fine)."""
    tree = SourceTree(root)
    items = (*HOOK_TARGETS, *OFF_SWITCH_TARGETS,
             Method(PARAMS, "AdaptiveSpeculativeParams", "__init__",
                    ("self", "initial_steps", "cfg_path")))
    return [p for item in items if (p := _check(tree, item))]


def contract_problems(root: str | Path, version: str) -> list[str]:
    """Problems with everything the plugin relies on, for a supported ``version``."""
    tree = SourceTree(root)
    return [p for item in CONTRACTS[version] if (p := _check(tree, item))]


def warmup_problems(root: str | Path) -> list[str]:
    """Problems with what the start-up warm-up relies on (:data:`WARMUP_CONTRACT`)."""
    tree = SourceTree(root)
    return [p for item in WARMUP_CONTRACT if (p := _check(tree, item))]


def append_only_problems(root: str | Path, item: AppendOnly = APPEND_ONLY) -> list[str]:
    """Where code under ``root`` changes a ``.<attr>`` list in place other than by
    appending (``path:line: code``; empty: nowhere). Only files that mention the
    attribute (or ``init_new``) are parsed: 84-91 of SGLang's 1,530-2,141."""
    base = Path(root).joinpath(*item.package.split("."))
    problems = []
    for path in sorted(base.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"{path}: not readable ({exc})")
            continue
        # (A cheap filter: every form checked below mentions one of these.)
        if f".{item.attr}" not in text and f"{item.attr}=" not in text and (
                "init_new(" not in text):
            continue
        try:
            module = ast.parse(text, str(path))
        except (SyntaxError, ValueError) as exc:
            problems.append(f"{path}: not parsed ({exc})")
            continue
        found: dict[int, str] = {}  # a nested function's findings are its outer one's too
        for node in ast.walk(module):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.update(_in_place_changes(node, item.attr))
        problems += [f"{path.relative_to(root)}:{line}: {code} changes a .{item.attr} "
                     "list in place (only appending is relied on)"
                     for line, code in sorted(found.items())]
    return problems


def _in_place_changes(function: ast.AST, attr: str) -> list[tuple[int, str]]:
    """(line, code) of each statement in ``function`` (nested ones included) that changes
    an ``X.<attr>`` list, or a name bound to one in it, other than at its end."""
    aliases: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node.value, ast.Attribute) and node.value.attr == attr:
                aliases.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node.value, ast.Name) and any(
                    isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
                aliases.add(node.value.id)  # X.reqs = name: the name is that list
        elif isinstance(node, ast.Call):
            aliases.update(k.value.id for k in node.keywords
                           if k.arg == attr and isinstance(k.value, ast.Name))
            if (isinstance(node.func, ast.Attribute) and node.func.attr == "init_new"
                    and node.args and isinstance(node.args[0], ast.Name)):
                aliases.add(node.args[0].id)

    def is_list(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == attr)
                or (isinstance(node, ast.Name) and node.id in aliases))

    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            changed = (isinstance(node.func, ast.Attribute) and node.func.attr in _REORDERING
                       and is_list(node.func.value))
        elif isinstance(node, ast.AugAssign):
            # += extends (appends); any other operator on a list (*=) changes it otherwise.
            changed = ((is_list(node.target) and not isinstance(node.op, ast.Add))
                       or (isinstance(node.target, ast.Subscript)
                           and is_list(node.target.value)))
        elif isinstance(node, (ast.Assign, ast.Delete)):
            changed = any(isinstance(t, ast.Subscript) and is_list(t.value)
                          for t in node.targets)
        else:
            changed = False
        if changed:
            found.append((node.lineno, ast.unparse(node).splitlines()[0]))
    return found


def _check(tree: SourceTree, item: Method | Attributes | Calls) -> str | None:
    where = f"{item.module}.{getattr(item, 'cls', None) or getattr(item, 'function', '')}"
    if tree.module(item.module) is None:
        return f"{item.module}: module source not found under {tree.root}"
    if isinstance(item, Method):
        node = tree.find(item.module, f"{item.cls}.{item.name}")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{item.target}: method not found"
        params = tuple(a.arg for a in (*node.args.posonlyargs, *node.args.args))
        if params[: len(item.params)] != item.params:
            return f"{item.target}: parameters {params}, expected to start with {item.params}"
        return None
    if isinstance(item, Attributes):
        node = tree.find(item.module, item.cls)
        if not isinstance(node, ast.ClassDef):
            return f"{where}: class not found"
        found = _assigned_names(node)
        missing = [n for n in item.names if n not in found]
        return f"{where}: attributes {missing} never assigned" if missing else None
    node = tree.find(item.module, item.function)
    if node is None:
        return f"{item.module}.{item.function}: not found"
    source = ast.unparse(node)
    missing = [s for s in item.snippets if s not in source]
    return f"{item.module}.{item.function}: does not contain {missing}" if missing else None


def _assigned_names(cls: ast.ClassDef) -> set[str]:
    """Class-level fields, methods/properties and every ``self.X = ...`` in the class."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    for node in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"):
                    names.add(sub.attr)
    return names
