"""The `calculator` tool: arithmetic evaluated by walking the syntax tree, never with eval.

Only numbers, + - * / // % **, unary signs, parentheses, the constants pi and e and a few math
functions are understood; anything else (names, attributes, subscripts, lambdas...) is an error. Work
is bounded before it is done: the expression's length and nesting, integer sizes (an exponent whose
result would exceed MAX_INT_BITS is refused, so `9**9**9` fails at once), and factorial arguments.
"""

import ast
import math
import operator

from rlsys.api.tool import Tool, ToolOutput, register_tool

MAX_LENGTH = 500  # characters of an expression
MAX_DEPTH = 50  # nesting of the syntax tree
MAX_INT_BITS = 4096  # about 1,200 decimal digits
MAX_FACTORIAL = 450  # 450! is about 3,700 bits
MAX_ROUND_DIGITS = 100

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
CONSTANTS = {"pi": math.pi, "e": math.e}
FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
             "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2, "sin": math.sin,
             "cos": math.cos, "tan": math.tan, "gcd": math.gcd, "lcm": math.lcm, "min": min, "max": max,
             "factorial": math.factorial, "comb": math.comb, "perm": math.perm}


class CalculatorError(ValueError):
    """The expression is not arithmetic we evaluate, or evaluating it would cost too much."""


def evaluate(expression: str) -> int | float:
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise CalculatorError(f"not an arithmetic expression: {type(e).__name__}") from None
    try:
        value = _eval(tree.body, depth=0)
    except CalculatorError:
        raise
    except (ArithmeticError, ValueError, TypeError) as e:  # 1/0, sqrt(-1), float overflow...
        raise CalculatorError(f"{type(e).__name__}: {e}") from None
    if not isinstance(value, (int, float)):
        raise CalculatorError(f"result is not a real number ({value})")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError(f"result is not finite ({value})")
    return value


def _eval(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        # a run of operators (1+2+...+60) is a chain down the left, not nesting: MAX_LENGTH bounds its recursion
        left, right = _eval(node.left, depth), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(BINARY[type(node.op)](left, right))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        args = [_eval(arg, depth + 1) for arg in node.args]
        _check_call(node.func.id, args)
        return _bounded(FUNCTIONS[node.func.id](*args))
    raise CalculatorError(f"unsupported: {ast.unparse(node)[:60]!r} (numbers, + - * / // % **, "
                          f"pi, e and {', '.join(FUNCTIONS)} only)")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses integer powers whose result would exceed MAX_INT_BITS, before computing them."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent > MAX_INT_BITS or (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise CalculatorError(f"an integer power would exceed {MAX_INT_BITS} bits")


def _check_call(name: str, args: list) -> None:
    """Arguments that would make a function run for long: big factorials, round(x, -10**9) (it builds 10**10**9)."""
    if name in ("factorial", "comb", "perm") and any(isinstance(a, int) and a > MAX_FACTORIAL for a in args):
        raise CalculatorError(f"{name} arguments are limited to {MAX_FACTORIAL}")
    if name == "round" and len(args) == 2 and isinstance(args[1], int) and abs(args[1]) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round() digits are limited to {MAX_ROUND_DIGITS}")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"integer larger than {MAX_INT_BITS} bits")
    return value


def format_number(value: int | float) -> str:
    """Integers exactly; floats with 12 significant digits, as integers when they are whole."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}" if isinstance(value, float) else str(value)


class CalculatorTool(Tool):
    description = "evaluates an arithmetic expression, e.g. (12+3)*sqrt(2)/7"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    async def call(self, expression: str) -> ToolOutput:
        try:
            return ToolOutput(format_number(evaluate(expression)))
        except CalculatorError as e:
            return ToolOutput(f"error: {e}", "error", str(e))


register_tool("calculator", CalculatorTool)
