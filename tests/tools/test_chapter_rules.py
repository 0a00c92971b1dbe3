"""Every message a chapter's tests match is stated in the text the student reads.

A test such as `pytest.raises(ValueError, match="different prefix")` grades
the wording of a message. A student who writes from the chapter text alone can
produce that wording only if the text asks for it; otherwise a grader run is
lost to a rule nobody could know. So for every `pytest.raises(..., match=...)`
in tests/chapters/test_chNN_*.py, for each chapter NN with an exercise (01-12; chapter
00's tests check given code only), this file requires:

1. an entry in RULES below, keyed by the test file, the test function and the
   source of the `match=` argument, quoting the sentence of the chapter text
   (chapters/NN-slug/README.md or chapters/NN-slug/exercise.py) that states
   what the message contains;
2. that quote to be in the text word for word (runs of whitespace, and the `#`
   starting a continued comment line, count as one space);
3. every word of the pattern (a run of letters, digits and `_` holding a
   letter, with a following `=` kept: "different", "prefix", "bucket=") to be
   in the quote, unless the entry lists it under `values`: words that are the
   value the message names, such as a dtype ("float64") the quote describes
   as "the dtype". Numbers (5, -1, 2.5) are values and are never required;
   the quote says which value the message names ("the count held before the
   count given"). For a pattern with alternatives (`a|b`) one alternative
   must pass.

The pattern is evaluated from the test's source: a string literal; an
f-string, `+`, `str()`, `repr()` or `re.escape()` of such parts; or a name the
test function binds to them (an assignment, a `for` over a literal list, a
`@pytest.mark.parametrize` argument). A part known only when the test runs,
such as `str(model.config.max_position_embeddings)`, counts as a value. A
pattern built any other way is reported as a failure, not skipped: write it
in one of these forms.

When you add a test that matches a message, either state the message in the
chapter text and add a RULES entry quoting that statement, or match only
values the text already says the message names. When you change a stated
rule in a text, this test points at every entry that quoted it.
"""
from __future__ import annotations

import ast
import dataclasses
import itertools
import pathlib
import re

import pytest

from minicb import impl
from minicb.check import CHAPTER_TESTS as TESTS, chapter_test_files

ROOT = impl.ROOT
CHAPTERS = sorted(number for number, _ in impl.CHAPTERS.values())  # the chapters with an exercise
RUNTIME = "\x00"  # stands for a part of a pattern known only when the test runs: a value


@dataclasses.dataclass(frozen=True)
class Rule:
    quote: str  # a sentence (or the part of one that says it) from the chapter text
    values: tuple[str, ...] = ()  # words of the pattern that are values the quote describes, not quotes


# (test file, test function, source of the match= argument) -> where the chapter text states it.
RULES: dict[tuple[str, str, str], Rule] = {
    # ---- chapter 01
    ("test_ch01_naive.py", "test_cache_refuses_to_overflow", "'4'"):
        Rule("Raise `RuntimeError` if `seq_len + T` does not fit, with the value of `max_len` in the message."),
    ("test_ch01_naive.py", "test_bad_prompts_raise_value_error_naming_the_length", "'empty'"):
        Rule('raises ValueError for an empty prompt (the message says "the prompt is empty")'),
    ("test_ch01_naive.py", "test_bad_prompts_raise_value_error_naming_the_length", "str(length)"):
        Rule("for a prompt of max_context tokens or more (the message names its length)"),
    # ---- chapter 03
    ("test_ch03_block_allocator.py", "test_blocks_needed_is_a_ceiling", "'-1'"):
        Rule("`blocks_needed` (`ValueError` naming the count when it is negative)"),
    ("test_ch03_block_allocator.py", "test_allocate_twice_is_an_error", "'5'"):
        Rule("`allocate`'s `ValueError` names the id in use"),
    ("test_ch03_block_allocator.py", "test_free_returns_blocks_and_rejects_unknown_ids", "'42'"):
        Rule("`UnknownSequenceError` names the unknown id."),
    ("test_ch03_block_allocator.py", "test_fork_errors", "'1'"):
        Rule("`ValueError` for a child id already in use (the message names that id)"),
    ("test_ch03_block_allocator.py", "test_slot_outside_the_sequence", "str(position)"):
        Rule("Raise `IndexError` for a position outside `0 <= position < num_tokens` (the message names the "
             "position)"),
    ("test_ch03_block_allocator.py", "test_memory_waste_rejects_bad_input", "'40'"):
        Rule("Raise `ValueError` for a length outside `[0, max_len]` (the message names the bad length, e.g. `40`)"),
    ("test_ch03_block_allocator.py", "test_memory_waste_rejects_bad_input", "'block_size'"):
        Rule("for a `max_len` or `block_size` that is not a positive int (the message names the parameter, "
             "e.g. `block_size`)"),
    # ---- chapter 04
    ("test_ch04_paged_attention.py", "test_decode_rejects_a_bad_block_id", r"'block_tables\\[1, 0\\] = 6'"):
        Rule("The messages name the entry, e.g. `block_tables[1, 0] = 6 is not a block id: ...`."),
    ("test_ch04_paged_attention.py", "test_prefill_rejects_bad_offsets", "message"):
        Rule("Raise `ValueError` mentioning `cu_seqlens_q` when it does not have `num_seqs + 1` entries, does not "
             "start at 0, does not end at `total_q_tokens`, or gives a sequence no queries. Raise `ValueError` "
             'naming the sequence as `sequence i` (e.g. "sequence 1") when its `q_len` exceeds its context '
             "length."),
    ("test_ch04_paged_attention.py", "test_store_kv_rejects_bad_input", "message"):
        Rule("Raise `ValueError` for mismatched shapes (put the shapes in the message, and the name of the "
             "argument that does not fit: `slot_mapping` when it does not hold one slot per token) or for a slot "
             "past the pool (put the slot in the message). Raise `TypeError` for mismatched dtypes or a "
             "non-integer `slot_mapping` (put the dtype in the message).",
             values=("float64", "float32")),  # the dtypes the message names
    # ---- chapter 05
    ("test_ch05_triton_attention.py", "test_store_kv_rejects_bad_inputs", "re.escape(words)"):
        Rule("check_store_args(k, v, k_cache, v_cache, slot_mapping): TypeError naming a wrong dtype (e.g. "
             "float16 against a float32 pool); ValueError naming a shape that does not fit (as a tuple, e.g. "
             "(3, 1, 16)), a slot past the pool (the slot, e.g. 32), or a device the kernels cannot read (e.g. "
             "meta)."),
    ("test_ch05_triton_attention.py", "test_attention_rejects_bad_inputs", "words"):
        Rule("TypeError naming a wrong dtype; ValueError naming a head_dim that differs, a context length past "
             "what the block table holds (the length), a block id that is negative or past the pool (the id), "
             "or a device the kernels cannot read (e.g. meta, or cpu when they are compiled for a GPU).",
             values=("float16",)),  # the dtype the message names
    ("test_ch05_triton_attention.py", "test_split_k_rejects_bad_num_splits", "str(num_splits)"):
        Rule("A `num_splits` that is not a positive int raises `ValueError` with the value in the message "
             "(e.g. `1.5`)."),
    ("test_ch05_triton_attention.py", "test_prefill_rejects_more_queries_than_context", "'cu_seqlens_q|q_len|context'"):
        Rule("or gives one more tokens than its context (`ValueError`, with `cu_seqlens_q` in the message)."),
    ("test_ch05_triton_attention.py", "test_compiled_kernels_on_gpu_smollm2_shape", "'cpu'"):
        Rule("or a device the kernels cannot read (e.g. meta, or cpu when they are compiled for a GPU)."),
    # ---- chapter 06
    ("test_ch06_engine.py", "test_bad_requests_are_refused_and_the_llm_keeps_serving", "field"):
        Rule("SamplingParams(...) (minicb.sampling, chapter 01) checks its own fields: ValueError naming the "
             "field and its value, e.g. max_tokens=0, temperature=-1.0, top_p=0.0 or top_p=1.5."),
    ("test_ch06_scheduler.py", "test_a_request_that_can_never_finish_is_rejected_up_front", "'4 blocks'"):
        Rule('or prompt + max_tokens needing more blocks than the whole pool (the message says "the pool has '
             'only N blocks", N = allocator.num_blocks).'),
    ("test_ch06_scheduler.py", "test_a_request_that_can_never_finish_is_rejected_up_front", "'empty'"):
        Rule('an empty prompt ("the prompt is empty")'),
    ("test_ch06_scheduler.py", "test_a_request_that_can_never_finish_is_rejected_up_front", "'context'"):
        Rule('a prompt as long as the model\'s context or longer (the message says "the model\'s context is" '
             "and max_model_len)"),
    # ---- chapter 07
    ("test_ch07_prefix_cache.py", "test_block_keys_chain_the_whole_prefix", "'0'"):
        Rule("Raise `ValueError` naming `block_size` and its value (`0` for `block_size=0`) unless it is a "
             "positive int."),
    ("test_ch07_prefix_cache.py", "test_allocate_prefix_out_of_blocks_changes_nothing", "'1'"):
        Rule("`ValueError` naming `seq_id` if it exists;"),
    ("test_ch07_prefix_cache.py", "test_append_errors_change_nothing", "'5'"):
        Rule("It raises `UnknownSequenceError` naming an unknown id."),
    ("test_ch07_prefix_cache.py", "test_errors_name_what_was_wrong", "'5.*6'"):
        Rule("Raise `ValueError` if `token_ids` is longer than `self.num_tokens(seq_id)`, with a message that "
             "gives the count held before the count given"),
    ("test_ch07_prefix_cache.py", "test_errors_name_what_was_wrong", "'7'"):
        Rule("`self._lookup(seq_id)` gives the sequence's block table, and raises `UnknownSequenceError` "
             "naming an unknown `seq_id`."),
    ("test_ch07_prefix_cache.py", "test_errors_name_what_was_wrong", "'different prefix'"):
        Rule('or if a block already has a *different* key, with the words "different prefix" in the message.'),
    ("test_ch07_prefix_cache.py", "test_errors_name_what_was_wrong", '"\'x\'"'):
        Rule("raises `TypeError` for anything but ints, naming the bad tokens by their repr (`'x'` for the "
             'string `"x"`).'),
    ("test_ch07_prefix_cache.py", "test_errors_name_what_was_wrong", "'9'"):
        Rule("the queries: `ref_count(block)` and `block_key(block)` (its key or None), both raising IndexError "
             "naming a block id that does not exist;"),
    # ---- chapter 08
    ("test_ch08_attention.py", "test_chunk_attention_scale_and_errors", "match"):
        Rule("Raise `ValueError` for shapes that do not fit, with a message that says which rule broke: for a "
             "`q_len` over `context_len`, one naming `q_len` (and both values); for `n_heads` not a multiple of "
             '`n_kv_heads`, one with the word "multiple"; for K and V of different shapes, one with the word '
             '"shape" and the shapes.'),
    ("test_ch08_attention.py", "test_chunk_attention_scale_and_errors", "'-1'"):
        Rule("Raise `ValueError` naming the value for a negative or non-int length, or `q_len > context_len`."),
    # task 3 raises "the same errors" as task 2: the statement is task 2's
    ("test_ch08_attention.py", "test_chunk_attention_triton_errors", "'q_len'"):
        Rule("for a `q_len` over `context_len`, one naming `q_len` (and both values);"),
    ("test_ch08_attention.py", "test_chunk_attention_triton_errors", "'multiple'"):
        Rule('for `n_heads` not a multiple of `n_kv_heads`, one with the word "multiple";'),
    # ---- chapter 10
    ("test_ch10_buckets.py", "test_batch_buckets_rejects_what_is_not_a_positive_int", "f'max_num_seqs={bad!r}'"):
        Rule("Raise `ValueError` naming it as `max_num_seqs=` and the value's repr (`max_num_seqs=0`, "
             "`max_num_seqs=2.5`, `max_num_seqs='8'` for the string `\"8\"`) unless it is an int >= 1."),
    ("test_ch10_buckets.py", "test_smallest_bucket_rejects_an_empty_step", "f'num_seqs={bad}'"):
        Rule("Raise `ValueError` naming it as `num_seqs=` and the value (`num_seqs=0`) unless `num_seqs` is an "
             "int >= 1."),
    ("test_ch10_padding.py", "test_bad_steps_are_value_errors", "match"):
        Rule('Raise `ValueError` for each bad step, with these words in the message (the tests match them): for '
             '`n < 1`, "no sequences"; for `n` over `bucket`, the bucket as `bucket=2`; for lists of different '
             'lengths, the list\'s name, e.g. "positions"; for a block table longer than `max_blocks`, the limit '
             "as `max_blocks=3`."),
}


# ---- finding the match= arguments --------------------------------------------------------------


class Unevaluable(Exception):
    """A match= pattern this file cannot work out from the source."""


class Runtime(Exception):
    """A value known only when the test runs."""


@dataclasses.dataclass
class Site:
    path: pathlib.Path
    line: int
    function: str
    error: str
    source: str  # ast.unparse of the match= argument
    patterns: list[str] | None  # None when it could not be evaluated
    problem: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return self.path.name, self.function, self.source

    def where(self) -> str:
        return (f"{self.path.relative_to(ROOT)}:{self.line} pytest.raises({self.error}, match={self.source}) "
                f"in {self.function}")


def _is_pytest_raises(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "raises"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest")


def _parametrized(function: ast.FunctionDef) -> dict[str, list[ast.expr]]:
    """name -> the argument values of @pytest.mark.parametrize("name, ...", [literal rows])."""
    bound: dict[str, list[ast.expr]] = {}
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr == "parametrize" and len(decorator.args) >= 2):
            continue
        names_node, rows_node = decorator.args[:2]
        if isinstance(names_node, ast.Constant) and isinstance(names_node.value, str):
            names = [n.strip() for n in names_node.value.split(",") if n.strip()]
        elif isinstance(names_node, (ast.List, ast.Tuple)):
            names = [n.value for n in names_node.elts if isinstance(n, ast.Constant)]
        else:
            continue
        if not isinstance(rows_node, (ast.List, ast.Tuple)):
            for name in names:
                bound.setdefault(name, []).append(None)  # rows built at run time
            continue
        for row in rows_node.elts:
            if isinstance(row, ast.Call) and getattr(row.func, "attr", "") == "param":  # pytest.param(...)
                row = ast.Tuple(elts=row.args) if len(names) > 1 else row.args[0]
            cells = row.elts if len(names) > 1 and isinstance(row, (ast.Tuple, ast.List)) else [row]
            for name, cell in zip(names, cells):
                bound.setdefault(name, []).append(cell)
    return bound


def _bind(target: ast.expr, value: ast.expr | None, bound: dict[str, list]) -> None:
    """Record what `target = value` binds; None for a value known only at run time."""
    if isinstance(target, ast.Name):
        bound.setdefault(target.id, []).append(value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        parts = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) \
            else [None] * len(target.elts)
        for sub_target, sub_value in zip(target.elts, parts):
            _bind(sub_target, sub_value, bound)


def _bindings(function: ast.FunctionDef, module: ast.Module) -> dict[str, list[ast.expr | None]]:
    """Every expression each name may hold inside `function` (None: only known when it runs)."""
    bound = _parametrized(function)
    for arg in function.args.args:
        bound.setdefault(arg.arg, [None])  # a fixture
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _bind(target, node.value, bound)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
            bound.setdefault(node.target.id, []).append(None)
        elif isinstance(node, ast.For):
            if isinstance(node.iter, (ast.List, ast.Tuple)):
                for element in node.iter.elts:
                    _bind(node.target, element, bound)
            else:
                _bind(node.target, None, bound)
    for node in module.body:  # module-level constants, unless the function binds the name itself
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id not in bound:
                    bound[target.id] = [node.value]
    return bound


def _values(node: ast.expr | None, bound) -> list[object]:
    """The Python values an expression may have; Runtime if one is known only when the test runs."""
    if node is None:
        raise Runtime
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return [-v for v in _values(node.operand, bound)]
    if isinstance(node, ast.Name):
        return [v for expr in bound.get(node.id, [None]) for v in _values(expr, bound)]
    if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Call) and _call_name(node) in ("str", "repr")):
        return _patterns(node, bound)
    raise Runtime


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def _formatted(node: ast.FormattedValue, bound) -> list[str]:
    try:
        values = _values(node.value, bound)
    except Runtime:
        return [RUNTIME]
    spec_parts = node.format_spec.values if node.format_spec else []
    if not all(isinstance(p, ast.Constant) for p in spec_parts):
        return [RUNTIME]
    spec = "".join(p.value for p in spec_parts)
    convert = {ord("r"): repr, ord("s"): str, ord("a"): ascii}.get(node.conversion, lambda v: v)
    return [format(convert(v), spec) for v in values]


def _patterns(node: ast.expr | None, bound) -> list[str]:
    """Every string the pattern may be; RUNTIME marks a value known only when the test runs."""
    if node is None:
        raise Unevaluable("it is bound to an expression known only when the test runs")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = [[p.value] if isinstance(p, ast.Constant) else _formatted(p, bound) for p in node.values]
        return ["".join(combo) for combo in itertools.product(*parts)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in _patterns(node.left, bound) for b in _patterns(node.right, bound)]
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        name = _call_name(node)
        if name in ("str", "repr"):
            try:
                return [str(v) if name == "str" else repr(v) for v in _values(node.args[0], bound)]
            except Runtime:
                return [RUNTIME]
        if name == "re.escape":
            return [re.escape(p).replace(re.escape(RUNTIME), RUNTIME) for p in _patterns(node.args[0], bound)]
    if isinstance(node, ast.Name):
        if node.id not in bound:
            raise Unevaluable(f"the test function does not bind {node.id!r}")
        return [p for expr in bound[node.id] for p in _patterns(expr, bound)]
    raise Unevaluable(f"{ast.unparse(node)!r} is not a string, an f-string, str(), repr(), re.escape() "
                      f"or a name bound to one")


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _own_nodes(function: ast.AST):
    """The nodes of `function`'s body, leaving out the bodies of functions defined inside it."""
    for child in ast.iter_child_nodes(function):
        if not isinstance(child, (*FUNCTIONS, ast.Lambda)):
            yield child
            yield from _own_nodes(child)


def match_sites(path: pathlib.Path, source: str | None = None) -> list[Site]:
    """Every pytest.raises(..., match=...) in the functions of one file, its pattern evaluated."""
    module = ast.parse(path.read_text() if source is None else source)
    sites = []
    for function in (node for node in ast.walk(module) if isinstance(node, FUNCTIONS)):
        bound = _bindings(function, module)
        for node in _own_nodes(function):  # a call inside a nested function is that function's
            match = next((k.value for k in node.keywords if k.arg == "match"), None) \
                if _is_pytest_raises(node) else None
            if match is None:
                continue
            error = ast.unparse(node.args[0]) if node.args else "?"
            site = Site(path, node.lineno, function.name, error, ast.unparse(match), None)
            try:
                site.patterns = sorted(set(_patterns(match, bound)))
            except Unevaluable as why:
                site.problem = str(why)
            except RecursionError:
                site.problem = "a name in it is bound to an expression that uses the name itself"
            sites.append(site)
    return sorted(sites, key=lambda s: s.line)


# ---- checking them against the text ------------------------------------------------------------


def chapter_dir(number: int) -> pathlib.Path:
    (folder,) = [folder for n, folder in impl.CHAPTERS.values() if n == number]
    return ROOT / "chapters" / folder


def flatten(text: str) -> str:
    """The text with every line break (and a comment's leading `#`) and run of spaces as one space."""
    return re.sub(r"\s+", " ", re.sub(r"\n[ \t]*#[ \t]?", "\n", text))


def chapter_text(number: int) -> str:
    folder = chapter_dir(number)
    return flatten((folder / "README.md").read_text() + "\n" + (folder / "exercise.py").read_text())


def pattern_words(pattern: str) -> list[list[str]]:
    """For each alternative of a regex pattern, the words a statement of it must contain."""
    literal = re.sub(r"\\[A-Za-z]", " ", pattern)  # a class such as \d or \s is no word of the message
    literal = re.sub(r"\\(.)", r"\1", literal)  # \( -> (
    alternatives = re.split(r"(?<!\\)\|", pattern) if "|" in pattern else [pattern]
    if len(alternatives) > 1:
        return [w for alt in alternatives for w in pattern_words(alt)]
    words = re.findall(r"\w+=?", literal.replace(RUNTIME, " "))
    return [[w for w in words if re.search(r"[A-Za-z]", w)]]


def has_word(quote: str, word: str) -> bool:
    """`word` in `quote` as a word of its own ("x" is not in "next"); "bucket=" may run on into a value."""
    end = "" if word.endswith("=") else r"(?!\w)"
    return re.search(rf"(?<!\w){re.escape(word)}{end}", quote) is not None


def problems_of(site: Site, rules: dict, text: str) -> list[str]:
    """What is missing for one match= site; [] when the text states it."""
    if site.patterns is None:
        return [f"{site.where()}: cannot work out the pattern ({site.problem}); build it from literals, "
                f"f-strings, str()/repr()/re.escape() or names bound to them"]
    rule = rules.get(site.key)
    if rule is None:
        return [f"{site.where()}: no entry {site.key!r} in RULES (tests/tools/test_chapter_rules.py). State in "
                f"{chapter_dir(chapter_of(site.path)).relative_to(ROOT)}/README.md or exercise.py what the "
                f"message must contain ({', '.join(map(repr, site.patterns))}), and quote that statement in RULES"]
    quote = flatten(rule.quote)
    if quote not in text:
        return [f"{site.where()}: RULES quotes {quote!r}, which is not in "
                f"{chapter_dir(chapter_of(site.path)).relative_to(ROOT)}/README.md or exercise.py; "
                f"restore the statement or update the quote"]
    problems = []
    for pattern in site.patterns:
        alternatives = pattern_words(pattern)
        missing = [[w for w in words if w.rstrip("=") not in rule.values and not has_word(quote, w)]
                   for words in alternatives]
        if all(missing):
            shown = pattern.replace(RUNTIME, "<value>")
            problems.append(f"{site.where()}: the pattern {shown!r} needs the word(s) "
                            f"{' / '.join(', '.join(map(repr, m)) for m in missing)}, which the quoted "
                            f"statement {quote!r} does not contain; put them in the statement (and the quote), "
                            f"or list them under values= if they are the value the message names")
    return problems


def chapter_of(path: pathlib.Path) -> int:
    return int(re.match(r"test_ch(\d\d)_", path.name)[1])


@pytest.mark.parametrize("number", CHAPTERS, ids=lambda n: f"ch{n:02d}")
def test_every_matched_message_is_stated_in_the_chapter_text(number):
    text = chapter_text(number)
    problems = [problem for path in chapter_test_files(number) for site in match_sites(path)
                for problem in problems_of(site, RULES, text)]
    assert not problems, (f"{len(problems)} message rule(s) of chapter {number:02d}'s tests are not stated in "
                          f"its text:\n  " + "\n  ".join(problems))


def test_every_rule_still_has_its_test():
    keys = {site.key for number in CHAPTERS for path in chapter_test_files(number)
            for site in match_sites(path)}
    stale = sorted(set(RULES) - keys)
    assert not stale, ("RULES entries with no pytest.raises(..., match=...) of that source in that test any "
                       "more; remove them or fix the key:\n  " + "\n  ".join(map(repr, stale)))


# ---- the checker itself: it evaluates what the tests write, and it fails ------------------------

EXAMPLE = '''
import re
import pytest

@pytest.mark.parametrize("case, words", [("a", "float16"), pytest.param("b", "bucket=2")])
@pytest.mark.parametrize("bad", [0, "8"])
def test_example(case, words, bad, device):
    with pytest.raises(ValueError, match=words):
        pass
    with pytest.raises(ValueError, match=f"max_num_seqs={bad!r}"):
        pass
    for length in [3, 4]:
        with pytest.raises(ValueError, match=str(length)):
            pass
    if case == "a":
        error, shape = TypeError, "(3, 1, 16)"
    else:
        error, shape = ValueError, str(device.index)
    with pytest.raises(error, match=re.escape(shape)):
        pass
    with pytest.raises(ValueError, match="different prefix"):
        pass
    with pytest.raises(ValueError, match=make_pattern()):
        pass
'''


def example_sites() -> list[Site]:
    return match_sites(TESTS / "test_ch07_example.py", EXAMPLE)


def test_patterns_are_worked_out_from_parametrize_loops_and_assignments():
    got = {site.source: site.patterns for site in example_sites()}
    want = {"words": ["bucket=2", "float16"], "f'max_num_seqs={bad!r}'": ["max_num_seqs='8'", "max_num_seqs=0"],
            "str(length)": ["3", "4"], "re.escape(shape)": [RUNTIME, re.escape("(3, 1, 16)")],
            "'different prefix'": ["different prefix"], "make_pattern()": None}
    assert got == want, f"patterns worked out from the example's source: {got}, want {want}"


def test_an_unstated_rule_fails_and_says_where():
    text = chapter_text(7)
    sites = {site.source: site for site in example_sites()}
    line = next(n for n, row in enumerate(EXAMPLE.splitlines(), 1) if 'match="different prefix"' in row)
    unknown = problems_of(sites["'different prefix'"], {}, text)
    assert len(unknown) == 1 and f"tests/chapters/test_ch07_example.py:{line} " in unknown[0] and "no entry" in unknown[0] \
        and "match='different prefix'" in unknown[0], unknown
    wordless = {sites["'different prefix'"].key: Rule("Check everything before changing anything.")}
    problems = problems_of(sites["'different prefix'"], wordless, text)
    assert len(problems) == 1 and "'different', 'prefix'" in problems[0], problems
    absent = {sites["'different prefix'"].key: Rule("a sentence no chapter has")}
    assert "not in chapters/07-prefix-caching" in problems_of(sites["'different prefix'"], absent, text)[0]
    not_built = problems_of(sites["make_pattern()"], {}, text)
    assert len(not_built) == 1 and "cannot work out the pattern" in not_built[0], not_built


def test_a_value_word_must_be_declared_and_a_value_is_never_required():
    sites = {site.source: site for site in example_sites()}
    quote = flatten("Raise `ValueError` naming it as `max_num_seqs=` and the value's repr")
    text = f"prefix {quote} suffix"
    assert problems_of(sites["f'max_num_seqs={bad!r}'"], {sites["f'max_num_seqs={bad!r}'"].key: Rule(quote)},
                       text) == [], "max_num_seqs= is in the quote and '8' or 0 are values"
    dtype = Rule(quote)
    assert problems_of(sites["words"], {sites["words"].key: dtype}, text), "float16 and bucket= are not in it"
    declared = Rule(quote, values=("float16", "bucket"))
    assert problems_of(sites["words"], {sites["words"].key: declared}, text) == []
    assert not has_word("the next token", "x") and has_word("the token 'x'", "x") and has_word("bucket=2", "bucket=")
