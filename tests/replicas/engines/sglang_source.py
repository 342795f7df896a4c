"""The pinned SGLang release's Python source, read from its wheel with zipfile + ast.

Nothing is imported from the wheel: a full SGLang install needs CUDA and GBs of kernels, and a
no-deps install would make `import sglang` half-work. .ci/run downloads the wheel (no dependencies)
into WHEEL_CACHE; the pin is pyproject.toml's `sglang` extra.
"""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
WHEEL_CACHE = REPO / ".ci" / "cache"
FIELDS_PACKAGE = "sglang.srt.arg_groups.fields"  # where ServerArgs' fields are declared, by namespace
ANNOTATED = ("A", "Annotated")  # SGLang's A[type, help] is typing.Annotated


def pinned_version() -> str:
    """X of the `sglang = ["sglang==X"]` extra in pyproject.toml."""
    match = re.search(r'^sglang = \["sglang==([\w.]+)"\]', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    if match is None:
        raise AssertionError('pyproject.toml must pin the extra exactly: sglang = ["sglang==<version>"]')
    return match.group(1)


def wheel_path() -> Path:
    version = pinned_version()
    wheels = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(
            f"no sglang-{version} wheel in {WHEEL_CACHE}: .ci/run downloads it with `pip download "
            f"--no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_34_x86_64 "
            f"-d .ci/cache sglang=={version}`")
    return wheels[0]


class SGLangSource:
    def __init__(self, wheel: Path) -> None:
        self.wheel = zipfile.ZipFile(wheel)
        self._modules: dict[str, ast.Module] = {}

    def text(self, path: str) -> str:
        return self.wheel.read(path).decode()

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self._modules:
            self._modules[dotted] = ast.parse(self.text(dotted.replace(".", "/") + ".py"))
        return self._modules[dotted]

    def cls(self, dotted_module: str, name: str) -> ast.ClassDef:
        for node in self.module(dotted_module).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{dotted_module} has no class {name}")

    def function(self, dotted_module: str, name: str) -> ast.FunctionDef:
        for node in self.module(dotted_module).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise AssertionError(f"{dotted_module} has no function {name}")

    @staticmethod
    def method(class_def: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        for node in class_def.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise AssertionError(f"{class_def.name} has no method {name}")

    @staticmethod
    def fields(class_def: ast.ClassDef) -> dict[str, ast.expr]:
        """A dataclass-like class's fields: name -> annotation."""
        return {node.target.id: node.annotation for node in class_def.body
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}

    def server_args_fields(self) -> dict[str, ast.expr]:
        """ServerArgs' fields: the union of the namespace classes listed in `_INPUT_NAMESPACES`."""
        server_args = self.module("sglang.srt.server_args")
        imported = {alias.name: node.module for node in server_args.body
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(FIELDS_PACKAGE)
                    for alias in node.names}
        (listing,) = [node.value for node in server_args.body if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets)]
        fields: dict[str, ast.expr] = {}
        for name in (element.id for element in listing.elts):
            fields |= self.fields(self.cls(imported[name], name))
        return fields


def type_names(annotation: ast.expr) -> set[str]:
    """The plain type names an annotation admits: A[Optional[float], "help"] -> {"float", "None"}."""
    if isinstance(annotation, ast.Name):
        return {annotation.id}
    if isinstance(annotation, ast.Constant):
        return {"None"} if annotation.value is None else type_names(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return type_names(annotation.left) | type_names(annotation.right)
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        outer, inner = annotation.value.id, annotation.slice
        elements = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        if outer in ANNOTATED:
            return type_names(elements[0])
        if outer == "Optional":
            return type_names(elements[0]) | {"None"}
        if outer == "Union":
            return set().union(*(type_names(e) for e in elements))
        return {outer}  # List[int], Set[int], Dict[...]: the container
    raise AssertionError(f"unexpected annotation {ast.unparse(annotation)}")


def keyword_value(annotation: ast.expr, keyword: str) -> object:
    """The literal value of `keyword=` in an annotation's Arg(...) metadata."""
    for node in ast.walk(annotation):
        if isinstance(node, ast.Call):
            for item in node.keywords:
                if item.arg == keyword:
                    return ast.literal_eval(item.value)
    raise AssertionError(f"{ast.unparse(annotation)} has no {keyword}=")
