"""The notebooks are stored clean and stay thin.

`make test` executes every notebook (pytest --nbmake notebooks); these tests
check what executing cannot:
- each notebook is stored without outputs, execution counts or widget state, so
  a diff shows only what someone wrote, never what a run happened to print;
- each imports from minicb and defines no library code of its own: a function
  longer than a few lines belongs in minicb/, where tests can reach it;
- each picks CUDA when it is there, and ends with the chapter's grading cell
  (chapters 01-12) or a self-check (chapter 00).
"""
import ast
import pathlib
import re

import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
EXPECTED = ["00-the-model", "01-naive-generation", "02-static-batching", "03-block-allocation",
            "04-paged-attention", "05-triton-attention", "06-continuous-batching", "07-prefix-caching",
            "08-chunked-prefill", "09-serving", "10-the-gpu-step", "11-speculative-decoding",
            "12-structured-output"]
MAX_DEF_LINES = 10  # tiny glue is fine; anything longer is library code

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def code_cells(nb) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def parse(source: str) -> ast.Module:
    # IPython lines (%magic, !shell) are not Python; blank them out, keeping line numbers.
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return ast.parse("\n".join(lines))


def test_every_chapter_has_its_notebook():
    found = [path.stem for path in NOTEBOOKS]
    missing = [name for name in EXPECTED if name not in found]
    assert not missing, f"notebooks missing from {NOTEBOOK_DIR}: {missing}; found {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [f"cell {i}: {len(cell.outputs)} output(s), execution_count {cell.execution_count}"
             for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (f"{path.name} was saved after running; clear outputs before committing "
                       f"(Jupyter: Edit > Clear Outputs of All Cells). Dirty cells: {dirty}")
    has_widget_state = "widgets" in nb.metadata
    assert not has_widget_state, f"{path.name} stores widget state in its metadata; clear it before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_thin_imports_minicb_and_defines_little(path):
    nb = nbformat.read(path, as_version=4)
    sources = code_cells(nb)
    imports = re.compile(r"^\s*(from minicb[\s.]|import minicb\b)", re.MULTILINE)
    assert any(imports.search(s) for s in sources), f"{path.name} never imports from minicb"
    too_long = []
    for index, source in enumerate(sources):
        for node in ast.walk(parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_DEF_LINES:
                    too_long.append(f"code cell {index}: {node.name} ({length} lines)")
    assert not too_long, (f"{path.name} defines code longer than {MAX_DEF_LINES} lines; move it into "
                          f"minicb/ and import it: {too_long}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_picks_cuda_when_available(path):
    sources = code_cells(nbformat.read(path, as_version=4))
    assert any("torch.cuda.is_available()" in s for s in sources), \
        f"{path.name} must choose its device with torch.cuda.is_available()"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ends_with_a_check(path):
    last = code_cells(nbformat.read(path, as_version=4))[-1]
    chapter = int(path.name[:2])
    if chapter == 0:
        assert "assert" in last, f"{path.name}: the last code cell should be a self-check with asserts, got:\n{last}"
    else:
        call = f'check(["{chapter}"'  # the grader, minicb.check.main, on this chapter (options may follow)
        assert call in last, f"{path.name}: the last code cell should grade chapter {chapter} with {call}...]), got:\n{last}"
