"""``compile`` for :class:`peftplug.lightning.PeftModule`: ``torch.compile`` of the wrapped model, whole-graph first.

``compile: true`` compiles the adapted model in place (``nn.Module.compile``: parameter names, checkpoints and exports
are unchanged) with ``fullgraph=True``. A model that dynamo cannot trace whole (a graph break somewhere in the base
model or an adapter) then falls back, at the first call that meets the break, to ``fullgraph=False`` — the breaks run
eagerly — with one warning naming the layer, the code line and dynamo's reason. ``compile: strict`` raises that line
as a :class:`~peftplug.errors.ConfigError` instead (CI, benchmarks). ``compile_options`` passes ``backend``,
``mode``, ``dynamic`` and ``options`` on to ``torch.compile``.

The other way ``fullgraph=True`` stops a run is dynamo's recompile limit (``torch._dynamo.config.recompile_limit``,
8 graphs of the model's forward): each new combination of grad mode, ``inference_mode``, batch size 1 or a
first-seen shape compiles a graph, and a fit with validation, a test before and after and a predict reaches it.
Without ``fullgraph`` dynamo runs such calls eagerly; with it, it raises. That too falls back (or, when strict,
stops in one line).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

from torch import nn

from peftplug.errors import ConfigError, one_line

COMPILE_CHOICES = (False, True, "strict")
COMPILE_OPTIONS = ("backend", "mode", "dynamic", "options")


def check_compile_settings(compile: bool | str, compile_options: dict | None) -> dict:
    """Validates ``model.compile`` / ``model.compile_options`` and returns the options as a dict.

    Args:
        compile: One of :data:`COMPILE_CHOICES`.
        compile_options: Keyword arguments of ``torch.compile`` among :data:`COMPILE_OPTIONS`, or ``None``.

    Raises:
        ConfigError: Naming the field and the accepted values.
    """
    if not (compile is True or compile is False or compile == "strict"):
        raise ConfigError(f"model.compile must be one of {list(COMPILE_CHOICES)}; got {compile!r}")
    if compile_options is not None and not isinstance(compile_options, dict):
        raise ConfigError(f"model.compile_options must be a mapping with keys among {list(COMPILE_OPTIONS)}; "
                          f"got {compile_options!r}")
    options = dict(compile_options or {})
    unknown = sorted(set(options) - set(COMPILE_OPTIONS))
    if unknown:
        raise ConfigError(f"model.compile_options: unknown key(s) {unknown}; accepted: {list(COMPILE_OPTIONS)} "
                          "(fullgraph is set by model.compile)")
    check_option_values(options)
    return options


def check_option_values(options: dict) -> None:
    """Refuses ``compile_options`` values that ``torch.compile`` would refuse only once the model is loaded (a mode
    typo: a RuntimeError; ``dynamic: auto``: a bare AssertionError), in one line naming the field.

    Args:
        options: The ``compile_options`` mapping (keys already checked).

    Raises:
        ConfigError: Naming the field and the accepted values.
    """
    mode, dynamic, inductor_options = options.get("mode"), options.get("dynamic"), options.get("options")
    if mode is not None:
        from torch._inductor import list_mode_options

        modes = list(list_mode_options())
        if mode not in modes:
            raise ConfigError(f"model.compile_options.mode must be one of {modes} or null; got {mode!r}")
    # ``is``, not ``in``: 1 == True, and torch.compile asserts a real bool.
    if not (dynamic is None or dynamic is True or dynamic is False):
        raise ConfigError("model.compile_options.dynamic must be true (symbolic shapes from the start), false "
                          f"(one graph per shape) or null (automatic, the default); got {dynamic!r}")
    if inductor_options is not None and not isinstance(inductor_options, dict):
        raise ConfigError(f"model.compile_options.options must be a mapping of Inductor settings; got "
                          f"{inductor_options!r}")
    if mode is not None and inductor_options is not None:
        raise ConfigError("model.compile_options: give mode or options, not both (torch.compile takes one of them)")
    backend = options.get("backend")
    if isinstance(backend, str):
        from torch._dynamo import lookup_backend
        from torch._dynamo.exc import InvalidBackend

        try:
            lookup_backend(backend)
        except InvalidBackend:
            raise ConfigError(f"model.compile_options.backend must be a registered dynamo backend (e.g. 'inductor', "
                              f"'aot_eager', 'eager'; torch._dynamo.list_backends() lists them); got {backend!r}"
                              ) from None
    elif backend is not None and not callable(backend):
        raise ConfigError(f"model.compile_options.backend must be a backend name or a callable; got {backend!r}")


def compile_model(model: nn.Module, fullgraph: bool, options: dict) -> None:
    """Compiles ``model`` in place (``nn.Module.compile``); tracing happens at its first call.

    Args:
        model: The adapted model.
        fullgraph: Refuse graph breaks (the first call raises at one).
        options: Further ``torch.compile`` keyword arguments.
    """
    model.compile(fullgraph=fullgraph, **options)


def is_graph_break(err: BaseException) -> bool:
    """Whether ``err`` is dynamo refusing to trace something whole (a graph break under ``fullgraph=True``).

    Args:
        err: An exception raised by a compiled call.
    """
    from torch._dynamo import exc

    return isinstance(err, (exc.Unsupported, exc.UserError))


def is_recompile_limit(err: BaseException) -> bool:
    """Whether ``err`` is dynamo refusing, under ``fullgraph=True``, to compile one more graph of a function that
    reached its recompile limit (without ``fullgraph`` dynamo would run that call eagerly instead).

    Args:
        err: An exception raised by a compiled call.
    """
    from torch._dynamo import exc

    # Named FailOnCacheLimitHit in older torch releases (their CacheLimitExceeded is an Unsupported: is_graph_break).
    types = tuple(getattr(exc, name) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, name))
    return isinstance(err, types)


def raised_by_model(err: BaseException) -> bool:
    """Whether the graph break ``err`` is an exception that the traced code itself raises and does not catch (a
    ``ValueError`` of the model for a bad batch, say): dynamo stops tracing there as at any break.

    Args:
        err: A graph break (see :func:`is_graph_break`).
    """
    from torch._dynamo import exc

    observed = getattr(exc, "ObservedException", None)
    return observed is not None and isinstance(err.__cause__, observed)


def run_eagerly(model: nn.Module, fn, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``model``'s in-place compilation (``nn.Module.compile``) switched off.

    Args:
        model: A model compiled by :func:`compile_model`.
        fn: A callable that runs it.
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.
    """
    compiled = model._compiled_call_impl
    model._compiled_call_impl = None
    try:
        return fn(*args, **kwargs)
    finally:
        model._compiled_call_impl = compiled


def describe_recompile_limit() -> str:
    """One line: which limit was reached and what compiles a new graph (dynamo logs the last guard that failed)."""
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # the older name
    return (f"the model's forward reached dynamo's recompile limit (torch._dynamo.config.{name} = {getattr(config, name)} "
            "graphs; each new grad mode, inference_mode, batch size 1 or input shape compiles one; "
            "TORCH_LOGS=recompiles names them)")


def _runs(code: Any, frame: Any, path: str) -> bool:
    """Whether ``frame`` (a traceback frame summary) executes ``code``: same file and name, and its line inside the
    code's lines (two classes of one file both define ``forward``)."""
    if code.co_name != frame.name or os.path.abspath(code.co_filename) != path:
        return False
    lines = [line for *_, line in code.co_lines() if line is not None]
    return bool(lines) and frame.lineno is not None and min(lines) <= frame.lineno <= max(lines)


def _owner(model: nn.Module, frame: Any) -> str | None:
    """The qualified name and class of the first module of ``model`` whose class defines the code of ``frame``."""
    path = os.path.abspath(frame.filename)
    for name, module in model.named_modules():
        for cls in type(module).__mro__:
            for value in vars(cls).values():
                code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
                if code is not None and _runs(code, frame, path):
                    return f"{name or '<model>'} ({type(module).__name__})"
    return None


def describe_graph_break(model: nn.Module, err: BaseException) -> str:
    """One line: the layer where dynamo stopped (innermost module of ``model`` on its stack), the line, the reason.

    Args:
        model: The compiled model.
        err: The dynamo error (see :func:`is_graph_break`).
    """
    stack = list(getattr(err, "real_stack", None) or [])
    where = f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else "an unknown line"
    layer = next((owner for frame in reversed(stack) if (owner := _owner(model, frame))), None)
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    if raised_by_model(err):  # "Observed exception": name the exception, "raised exception RuntimeError('...')"
        reason = f"{reason}: {err.__cause__}"
    return one_line(f"layer {layer or 'unknown'} at {where}: {reason}", limit=600)


def fall_back_or_raise(model: nn.Module, err: BaseException, strict: bool, options: dict) -> None:
    """Handles a graph break or the recompile limit met under ``fullgraph=True``: one-line error (``strict``) or a
    warned fallback.

    Args:
        model: The compiled model (recompiled without ``fullgraph`` when not ``strict``).
        err: The dynamo error.
        strict: Raise instead of falling back.
        options: The ``torch.compile`` options to recompile with.

    Raises:
        ConfigError: When ``strict``, naming the layer and the reason.
    """
    if is_recompile_limit(err):
        what, where, eager, fallback = ("cannot compile one more graph", describe_recompile_limit(),
                                        "calls past the limit run eagerly", "eager calls past the limit")
    else:
        what, where, eager, fallback = ("cannot trace the model whole", describe_graph_break(model, err),
                                        "that part runs eagerly", "graph breaks")
    if strict:
        raise ConfigError(f"model.compile: strict: torch.compile(fullgraph=True) {what}: {where}"
                          f" (set model.compile: true to fall back to {fallback})") from err
    warnings.warn(f"peftplug: torch.compile(fullgraph=True) {what}, falling back to fullgraph=False ({eager}): "
                  f"{where}", stacklevel=3)
    compile_model(model, fullgraph=False, options=options)


class ModelCompiler:
    """What :class:`~peftplug.lightning.PeftModule` does for ``compile``: validate, compile, fall back once.

    Args:
        compile: One of :data:`COMPILE_CHOICES`.
        compile_options: See :func:`check_compile_settings`.

    Raises:
        ConfigError: For invalid settings (before any model is loaded).
    """

    def __init__(self, compile: bool | str = False, compile_options: dict | None = None) -> None:
        self.options = check_compile_settings(compile, compile_options)
        self.strict = compile == "strict"
        self.fullgraph = compile is not False
        self.model: nn.Module | None = None

    def attach(self, model: nn.Module) -> None:
        """Compiles ``model`` in place with ``fullgraph=True`` when compiling is on (else does nothing).

        Args:
            model: The adapted model.
        """
        self.model = model
        if self.fullgraph:
            compile_model(model, fullgraph=True, options=self.options)

    def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; a graph break or the recompile limit under ``fullgraph=True`` falls back (or
        raises, when strict).

        Dynamo refuses either before running anything (while tracing, or at the frame's entry), so repeating the
        call is safe. An exception raised by the model itself (a bad batch) stops tracing like a break: that call runs
        eagerly, so that the model's own error is what the user sees, and only if it then succeeds is it a break.

        Args:
            fn: A callable that runs the compiled model.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.
        """
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # re-raised below unless dynamo refused a graph break or one more recompile
            if not (self.fullgraph and self.model is not None and (is_graph_break(err) or is_recompile_limit(err))):
                raise
            result = run_eagerly(self.model, fn, *args, **kwargs) if raised_by_model(err) else None
            fall_back_or_raise(self.model, err, self.strict, self.options)
            self.fullgraph = False
            if raised_by_model(err):
                return result  # computed eagerly above; running it again would repeat its random draws (dropout)
        return fn(*args, **kwargs)
