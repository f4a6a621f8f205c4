"""A safe arithmetic evaluator: the text of an arithmetic expression to its exact value,
never through eval/exec. It is the engine of the calculator tool (rl.envs.calculator), and it
reads text a policy wrote, so every input is untrusted: nothing in it may run code, touch a
name, or cost more than a bounded amount of time and memory.

    calculate("12,345 * 678")   -> "8369910"
    calculate("7 / 2")          -> "3.5"
    calculate("2 ** 10 ** 10")  -> "error: exponent too large (at most 64)"
    calculate("__import__('os')") -> "error: function calls are not allowed"

What it accepts. The text is parsed by Python's `ast` (mode="eval") and the tree is walked
by hand; allowed are only

  * numbers: int and float literals (not bool, complex, strings, ...);
  * binary operators + - * / // % ** and unary + -; parentheses (they are only grouping).
Before parsing, the spellings models use are normalised: a comma between digit groups
("12,345" -> "12345"), "×" -> "*", "÷" -> "/", "^" -> "**".

What it refuses, and why. Everything else is refused with an error naming what is not
allowed ("error: names are not allowed", "error: attributes are not allowed", "error:
function calls are not allowed", "error: strings are not allowed", ...): names, attributes,
calls, subscripts, lambdas and comprehensions are how an expression reaches code, and
comparisons, containers, strings and the rest are not arithmetic. Arithmetic is exact
(fractions.Fraction; a float literal is its exact binary value), except a non-integer power,
which is a float. Exact numbers can grow without end (9 ** 9 ** 9 has 370 million digits),
so bounds, each checked before the work it guards, keep every call fast:

  * MAX_CHARS characters of input, MAX_NODES tree nodes, MAX_DIGITS digits per integer
    literal;
  * an integer exponent of at most MAX_EXPONENT in size, and a power whose result would
    pass the magnitude bound is refused before it is computed (2 ** 10 ** 10 is an error
    at once);
  * every intermediate and the result: |value| <= 10 ** MAX_RESULT_DIGITS, and its
    numerator / denominator within MAX_BITS bits.
Division by zero, a negative number to a fractional power and text that does not parse are
errors too. The result prints as an integer when it is one, else with 12 significant digits.

`evaluate` returns the exact value or raises CalculatorError; `calculate` is the tool's
view: the value as text or "error: <why>", never raising on any input. `count_operations`
and `reduction_steps` serve a calculator that takes one operation per call.
"""
from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from fractions import Fraction

MAX_CHARS = 200
MAX_NODES = 64
MAX_DIGITS = 30
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 30
MAX_BITS = 512
_LIMIT = Fraction(10) ** MAX_RESULT_DIGITS

_NOT_ALLOWED = {  # node type -> what the error names
    ast.Name: "names", ast.Attribute: "attributes", ast.Call: "function calls",
    ast.Subscript: "subscripts", ast.Lambda: "lambdas", ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions", ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions", ast.Compare: "comparisons", ast.BoolOp: "boolean operators",
    ast.IfExp: "conditional expressions", ast.List: "lists", ast.Tuple: "tuples",
    ast.Set: "sets", ast.Dict: "dicts", ast.JoinedStr: "strings", ast.Starred: "starred expressions",
    ast.NamedExpr: "assignments", ast.Await: "await", ast.Yield: "yield", ast.YieldFrom: "yield",
    ast.Slice: "slices",
}
# each allowed binary operator: its symbol (how reduction_steps writes it) and its function
# (** goes through _power, which bounds the result before computing it)
_BINOPS = {ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub),
           ast.Mult: ("*", operator.mul), ast.Div: ("/", operator.truediv),
           ast.FloorDiv: ("//", operator.floordiv), ast.Mod: ("%", operator.mod),
           ast.Pow: ("**", None)}
_ALLOWED_OPS = " ".join(symbol for symbol, _ in _BINOPS.values())
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalculatorError(ValueError):
    """Why an expression was refused (the text after "error: ")."""


def _check_size(x: Fraction) -> Fraction:
    if abs(x) > _LIMIT:
        raise CalculatorError(f"number too large (limit 1e{MAX_RESULT_DIGITS})")
    if x.numerator.bit_length() > MAX_BITS or x.denominator.bit_length() > MAX_BITS:
        raise CalculatorError("number too precise (a fraction with too many digits)")
    return x


def _power(base: Fraction, exp: Fraction) -> Fraction:
    if exp.denominator == 1:
        e = exp.numerator
        if abs(e) > MAX_EXPONENT:
            raise CalculatorError(f"exponent too large (at most {MAX_EXPONENT})")
        if base == 0 and e < 0:
            raise CalculatorError("division by zero")
        # |base ** e| in log10, checked before computing it
        if base != 0 and abs(e) * abs(math.log10(abs(base.numerator)) - math.log10(base.denominator)) \
                > MAX_RESULT_DIGITS + 1:
            raise CalculatorError(f"number too large (limit 1e{MAX_RESULT_DIGITS})")
        return base ** e
    if base < 0:
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if float(exp) * math.log10(max(float(base), 1e-300)) > MAX_RESULT_DIGITS + 1:
        raise CalculatorError(f"number too large (limit 1e{MAX_RESULT_DIGITS})")
    try:
        return Fraction(float(base) ** float(exp))
    except (OverflowError, ValueError) as err:
        raise CalculatorError(f"power failed ({err})") from None


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            kind = "strings" if isinstance(v, (str, bytes)) else f"{type(v).__name__} constants"
            raise CalculatorError(f"{kind} are not allowed, only numbers")
        if isinstance(v, float) and not math.isfinite(v):
            raise CalculatorError("number too large")
        return _check_size(Fraction(v))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(a, b))
        if b == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalculatorError("division by zero")
        return _check_size(Fraction(_BINOPS[type(node.op)][1](a, b)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed "
                              f"(only {_ALLOWED_OPS})")
    what = _NOT_ALLOWED.get(type(node), type(node).__name__)
    raise CalculatorError(f"{what} are not allowed, only numbers and {_ALLOWED_OPS} ( )")


def format_number(x: Fraction) -> str:
    """An integer as its digits; anything else with 12 significant digits."""
    if x.denominator == 1:
        return str(x.numerator)
    return format(float(x), ".12g")


def evaluate(expression: str) -> Fraction:
    """The exact value of an allowed arithmetic expression; CalculatorError otherwise."""
    return _eval(_parse(expression))


def count_operations(expression: str) -> int:
    """How many binary operations (+ - * / // % **) an allowed expression has (a sign is
    not one: "-3 * 4" has one); CalculatorError if it is not an allowed expression."""
    tree = _parse(expression)
    _eval(tree)  # refuses what evaluate refuses
    return sum(isinstance(n, ast.BinOp) for n in ast.walk(tree))


def reduction_steps(expression: str) -> list[str]:
    """The expression as one-operation calculations in evaluation order, each with the
    earlier results written in: "5802 + 917 + 3409" -> ["5802 + 917", "6719 + 3409"]
    (what a calculator that takes one operation per call is asked, in turn). An expression
    with no operation gives []; CalculatorError if it is not an allowed expression. A
    non-integer result is written with format_number's 12 significant digits, so a chain
    through one can end a few units in the last digit from the exact value."""
    steps: list[str] = []

    def reduce(node: ast.AST) -> str:
        if isinstance(node, ast.BinOp):
            step = f"{reduce(node.left)} {_BINOPS[type(node.op)][0]} {reduce(node.right)}"
            steps.append(step)
            return format_number(evaluate(step))
        if isinstance(node, ast.UnaryOp):  # a sign: not a step, but its operand may hold some
            return format_number(_UNARY[type(node.op)](evaluate(reduce(node.operand))))
        return format_number(_eval(node))

    reduce(_parse(expression).body)
    return steps


def _parse(expression: str) -> ast.Expression:
    """The checked syntax tree of an expression (the bounds of the module docstring);
    CalculatorError for text that is too long, too large or does not parse."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression too long ({len(text)} characters, at most {MAX_CHARS})")
    text = _DIGIT_COMMA.sub("", text).replace("×", "*").replace("÷", "/").replace("^", "**")
    for run in re.findall(r"\d+", text):
        if len(run) > MAX_DIGITS:
            raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
    try:
        with warnings.catch_warnings():  # e.g. "invalid escape sequence" in a string literal
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not a valid arithmetic expression") from None
    nodes = sum(1 for n in ast.walk(tree) if not isinstance(n, (ast.operator, ast.unaryop,
                                                                  ast.expr_context)))
    if nodes > MAX_NODES + 1:  # + the Expression wrapper
        raise CalculatorError(f"expression too large ({nodes - 1} nodes, at most {MAX_NODES})")
    return tree


def calculate(expression: str) -> str:
    """The calculator tool: the value as text, or "error: <why>" (never raises on any
    string input)."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as err:
        return f"error: {err}"
