"""API errors and their two wire shapes (OpenAI's `{"error": {...}}` and Anthropic's `{"type": "error", ...}`).

Every failure the server reports goes through `ApiError`, so a client always gets a status code it can act on
and a body its SDK can parse; the route decides which shape (the Anthropic endpoints live under /v1/messages).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def body(self, anthropic: bool) -> dict[str, Any]:
        return self.anthropic_body() if anthropic else self.openai_body()


def from_validation(err: ValidationError) -> ApiError:
    """A 400 naming the offending field (pydantic reports it as a location path)."""
    loc, msg, more = first_problem(err)
    text = f"{loc}: {msg}" if loc else msg
    if more:
        text += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ApiError(400, text, code="invalid_request", param=loc or None)


def first_problem(err: ValidationError) -> tuple[str, str, int]:
    """(location, message, how many other places are wrong) of a validation error.

    A value that matches no member of a union (`str | list[TextPart]`) fails once per member; the deepest
    location is the member the client meant (the list, not the string), and the other members' failures at
    the same place are no further problems of the request. A `located` error (raised by schemas.located)
    carries the location its validator found, below the one pydantic reports."""
    problems = []
    for e in err.errors():
        parts = [str(p) for p in e.get("loc", ()) if not _is_union_tag(p)]
        msg = e.get("msg", "invalid value").removeprefix("Value error, ")
        if e.get("type") == LOCATED:  # its path is relative to where its validator ran
            ctx = e.get("ctx") or {}
            parts += [str(ctx["path"])] if ctx.get("path") else []
            msg = str(ctx.get("message", msg))
        problems.append((".".join(parts), msg))
    loc, msg = max(problems, key=lambda p: _depth(p[0]))  # max keeps the first of equals
    others = {other for other, _ in problems if other != loc and not loc.startswith(other + ".")}
    return loc, msg, len(others)


# The error type of schemas.located: a validator that knows a deeper location than pydantic's.
LOCATED = "located"


def _depth(loc: str) -> int:
    return loc.count(".") + 1 if loc else 0


def _is_union_tag(part: Any) -> bool:
    # pydantic inserts the union member's type name ("str", "list[TextPart]", "function-after[...]", a model's
    # class name such as "AToolResult") into locations; they mean nothing to a client. Field names here are
    # lower case, so a capitalised identifier is a class name.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict")
                                      or "[" in part or part.startswith(("function-", "literal", "Strict"))
                                      or (part[:1].isupper() and part.isidentifier()))
