"""A step's config class as KFP parameters, one per field, derived from the class.

KFP builds a component's interface from its Python signature (``inspect.signature``) and
ships the function's source text (``inspect.getsource``) into the container, where the
executor calls it with one keyword argument per input. ``with_config_fields`` writes that
signature from the config class: the component is written with one ``config: dict``
parameter, and the function KFP sees takes the class's fields one by one and rebuilds the
dict first thing, so the shipped source holds the same signature. ``with_config_parameters``
does the same for a pipeline (whose source KFP does not ship, so a signature is enough), with
the config's values as defaults. Adding a field to the class adds it to the component and to
the pipeline's parameters, a form field each in the KFP UI, with no other edit.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel

_SCALARS = (str, int, float, bool)


class UnsupportedFieldError(TypeError):
    """A config field whose type no KFP parameter type can carry."""


def parameter_type(config_class: type[BaseModel], name: str) -> tuple[type, bool]:
    """The KFP parameter type of a config field, and whether the field may be ``None``.

    ``str``, ``int``, ``float``, ``bool`` and a ``Literal`` of one of them are themselves; lists,
    tuples and sets are ``list``; mappings and nested models are ``dict``. A number or a word
    (``int | Literal["auto"]``) is ``str``: the parameter carries the text (``"auto"``,
    ``"9"``) and the class parses it.

    Raises:
        UnsupportedFieldError: The field's type maps to none of these (the message names it).
    """
    annotation = config_class.model_fields[name].annotation
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(members) < len(get_args(annotation))
        if len(members) > 1 and _number_or_word(members):
            return str, optional
        annotation = members[0] if len(members) == 1 else annotation
    origin = get_origin(annotation) or annotation
    if origin is Literal:
        kinds = {type(value) for value in get_args(annotation)}
        if len(kinds) == 1 and kinds <= set(_SCALARS):
            return kinds.pop(), optional
    elif origin in _SCALARS:
        return origin, optional
    elif origin in (list, tuple, set, frozenset):
        return list, optional
    elif origin is dict or (isinstance(origin, type) and issubclass(origin, Mapping | BaseModel)):
        return dict, optional
    raise UnsupportedFieldError(
        f"{config_class.__name__}.{name}: type {annotation!r} has no KFP parameter type; "
        "give the field a str, int, float, bool, Literal, list, dict or nested-model type"
    )


def _number_or_word(members: list) -> bool:
    """Whether a union's members are numbers and string literals (``int | Literal["auto"]``)."""
    kinds = set()
    for member in members:
        if get_origin(member) is Annotated:
            member = get_args(member)[0]
        if get_origin(member) is Literal:
            kinds |= {type(value) for value in get_args(member)}
        else:
            kinds.add(member)
    return str in kinds and bool(kinds & {int, float}) and kinds <= {str, int, float}


def config_dict(config: BaseModel) -> dict:
    """A step config as a KFP dict parameter (JSON types). ``None`` values are left out, at
    every depth: KFP structs cannot hold null, and an optional parameter left unset is
    ``None``."""
    return config.model_dump(mode="json", exclude_none=True)


def config_arguments(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """The config's values as KFP arguments (``config_dict``), keyed ``<prefix><field>``; a
    field carried as text (``parameter_type``) gets its value as text."""
    out = {}
    for name, value in config_dict(config).items():
        if not isinstance(value, str) and parameter_type(type(config), name)[0] is str:
            value = str(value)
        out[prefix + name] = value
    return out


def _annotation_source(kind: type, optional: bool) -> str:
    return f"Optional[{kind.__name__}]" if optional else kind.__name__


def _check_names(config_class: type[BaseModel], names: list[str], taken: list[str]) -> None:
    clash = sorted(set(names) & set(taken))
    if clash:
        raise ValueError(
            f"{config_class.__name__} field(s) {clash} have the name of another parameter of "
            "the function; rename the field or the parameter"
        )


def with_config_fields(config_class: type[BaseModel], param: str = "config") -> Callable:
    """Decorator for a component function (under ``@dsl.component``): its parameter ``param``
    becomes one parameter per field of ``config_class``, in the fields' order.

    Inside the body ``param`` is the dict of those fields' values (validate it with
    ``config_class.model_validate``). A field that may be ``None`` becomes
    ``Optional[<type>] = None``; every other field is a required input.

    Raises:
        UnsupportedFieldError: A field has a type KFP cannot carry.
        ValueError: ``param`` is not a parameter of the function, or has a default, or a field
            has the name of another parameter.
    """

    def decorate(func: Callable) -> Callable:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        definition = tree.body[0]
        if not isinstance(definition, ast.FunctionDef):
            raise ValueError(f"with_config_fields decorates a function, not {func!r}")
        definition.decorator_list = []
        arguments = definition.args
        names = [a.arg for a in arguments.args]
        n_required = len(names) - len(arguments.defaults)
        if param not in names[:n_required]:
            raise ValueError(
                f"{func.__qualname__} has no parameter {param!r} without a default to expand "
                f"into {config_class.__name__}'s fields"
            )
        fields = list(config_class.model_fields)
        _check_names(config_class, fields, [n for n in names if n != param])
        required, optional = [], []
        for name in fields:
            kind, may_be_none = parameter_type(config_class, name)
            arg = ast.arg(name, ast.parse(_annotation_source(kind, may_be_none)).body[0].value)
            (optional if may_be_none else required).append(arg)
        index = names.index(param)
        # required fields take the place of `param`; optional ones (default None) come first
        # among the parameters with defaults, so the signature stays valid
        arguments.args[index : index + 1] = required
        first_default = len(arguments.args) - len(arguments.defaults)
        arguments.args[first_default:first_default] = optional
        arguments.defaults[0:0] = [ast.Constant(None) for _ in optional]
        rebuild = f"{param} = dict({', '.join(f'{n}={n}' for n in fields)})"
        body = definition.body
        has_docstring = (
            body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        )
        body.insert(1 if has_docstring else 0, ast.parse(rebuild).body[0])
        source = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
        # inspect.getsource (KFP reads it to ship the function) finds generated source in
        # linecache, under the file name the code object carries
        filename = f"<{func.__module__}.{func.__qualname__}: {config_class.__name__} fields>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {**func.__globals__, "Optional": Optional}
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)  # noqa: S102 (our own source)
        return namespace[definition.name]

    return decorate


def with_config_parameters(config: BaseModel, prefix: str, param: str) -> Callable:
    """Decorator for a pipeline function: its parameter ``param`` becomes one parameter per
    field of ``config``'s class, named ``<prefix><field>``, defaulting to ``config``'s values.

    Inside the body ``param`` is the dict field → the pipeline's parameter (a KFP channel),
    ready for ``component(**param)``. KFP calls a pipeline function with every parameter, in
    the signature's order, to build the DAG; it does not ship its source, so the signature is
    given as ``__signature__``.

    Raises:
        UnsupportedFieldError: A field has a type KFP cannot carry.
        ValueError: ``param`` is not a parameter of the function, or a generated name is
            taken.
    """
    config_class = type(config)
    defaults = config_arguments(config)

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func)
        if param not in signature.parameters:
            raise ValueError(f"{func.__qualname__} has no parameter {param!r}")
        fields = {prefix + name: name for name in config_class.model_fields}
        _check_names(config_class, list(fields), [n for n in signature.parameters if n != param])
        generated = []
        for full_name, name in fields.items():
            kind, may_be_none = parameter_type(config_class, name)
            generated.append(
                inspect.Parameter(
                    full_name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=defaults.get(name),
                    annotation=Optional[kind] if may_be_none else kind,  # noqa: UP045 (KFP)
                )
            )
        parameters = list(signature.parameters.values())
        index = list(signature.parameters).index(param)
        parameters[index : index + 1] = generated
        expanded = signature.replace(parameters=parameters)

        @functools.wraps(func)
        def pipeline(*args, **kwargs):
            bound = expanded.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            values[param] = {name: values.pop(full_name) for full_name, name in fields.items()}
            return func(**values)

        pipeline.__signature__ = expanded
        return pipeline

    return decorate
