"""Reading a launch script such as the PAI guide's ``run_dsw_7b.sh``: the one call of
``run_mcore_qwen*.sh`` in it, with the arguments and environment that call gets.

This is a small subset of bash, enough for launch scripts as they are written: line
continuations, comments, ``;`` / ``&&`` / ``||`` / ``|`` lists, ``VAR=value cmd`` prefixes,
``export`` / ``unset`` lines, ``$VAR`` / ``${VAR}`` and wrappers such as ``sh`` or ``nohup``.
Anything it cannot evaluate (command substitution, an unknown variable) is an error rather
than a guess, since one wrong word would shift every positional argument after it.

It also reads one branch of an ``if [ $VAR = value ]`` chain of the launch script itself
(:func:`branch_assignments`): run_mcore_qwen3.sh describes each MODEL_SIZE with variables and
option strings there, which a user's copy may have edited.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from pathlib import Path
from typing import Iterator, Mapping, Optional

from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration.launch import Launch

CALLED_SCRIPT = re.compile(r"run_mcore_qwen[\w.-]*\.sh")


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each shell line, backslash-newline continuations joined."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.endswith("\\") and not line.lstrip().startswith("#"):
            pending += line[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a line (split at ; && || |), comments dropped, quotes removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def expand(token: str, variables: Mapping[str, str], where: str) -> str:
    """``$VAR`` / ``${VAR}`` from the variables known at that point; anything else is an error
    (an unknown variable would shift the positional arguments)."""
    if "$(" in token or "`" in token:
        raise MigrationError(f"{where}: command substitution in {token!r} cannot be evaluated")

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise MigrationError(f"{where}: ${name} is not set in the script or the environment")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, token)


ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)=(.*)", re.S)
WRAPPERS = {"sh", "bash", "source", ".", "exec", "nohup", "time", "env"}


def script_commands(path: Path, lines: list[tuple[int, str]]
                    ) -> Iterator[tuple[str, int, list[str]]]:
    """(``path:line``, line number, words) of each simple command of a script's ``lines``;
    a line the shell splitter cannot split is a MigrationError naming it."""
    for number, line in lines:
        where = f"{path}:{number}"
        try:
            commands = simple_commands(line)
        except ValueError as err:
            raise MigrationError(f"{where}: cannot split the line ({err})") from None
        for words in commands:
            yield where, number, words


def parse_script(path: Path, environ: Mapping[str, str]) -> Launch:
    """The one call of ``run_mcore_qwen*.sh`` in a launch script: its arguments and environment."""
    variables, exported = dict(environ), set(environ)
    calls = []
    for where, _, words in script_commands(path, logical_lines(path.read_text())):
        words = [expand(w, variables, where) for w in words]
        if words[0] in ("export", "unset"):
            for word in words[1:]:
                match = ASSIGNMENT.fullmatch(word)
                if words[0] == "unset":
                    variables.pop(word, None)
                    exported.discard(word)
                elif match:
                    variables[match.group(1)] = match.group(2)
                    exported.add(match.group(1))
                else:
                    exported.add(word)
            continue
        prefix = {}
        while words and ASSIGNMENT.fullmatch(words[0]):
            key, value = ASSIGNMENT.fullmatch(words.pop(0)).groups()
            prefix[key] = value
        while words and words[0] in WRAPPERS:
            words.pop(0)
            while words and ASSIGNMENT.fullmatch(words[0]):  # env VAR=value cmd
                key, value = ASSIGNMENT.fullmatch(words.pop(0)).groups()
                prefix[key] = value
        if not words:
            variables.update(prefix)  # VAR=value alone: a shell variable
            continue
        if CALLED_SCRIPT.fullmatch(posixpath.basename(words[0])):
            env = {k: variables[k] for k in exported if k in variables} | prefix
            calls.append(Launch(tuple(words[1:]), env, posixpath.basename(words[0]),
                                f"{where}"))
    if len(calls) != 1:
        found = ", ".join(c.source for c in calls) or "none"
        raise MigrationError(f"{path}: expected one call of run_mcore_qwen*.sh, found "
                             f"{len(calls)} ({found}); pass the script's arguments directly "
                             f"instead")
    return calls[0]


BRANCH_END = re.compile(r"(?:elif|else|fi)\b")
NESTED_IF = re.compile(r"(?:if|case)\b")
SKIP = re.compile(r"(?:\s+|#[^\n]*)+")
# NAME="..." (backslash escapes kept for the caller), NAME='...' (literal) or NAME=word
BRANCH_ASSIGNMENT = re.compile(
    r"""([A-Za-z_]\w*)=(?:"((?:[^"\\]|\\.)*)"|'([^']*)'|([^\s;#"']*))""", re.S)


def branch_assignments(path: Path, variable: str, value: str, known: Mapping[str, str]
                       ) -> Optional[tuple[dict[str, str], dict[str, str]]]:
    """The variables the ``[ $variable = value ]`` branch of an if / elif chain assigns, as bash
    leaves them (backslash-newlines inside double quotes removed, ``$VAR`` expanded from
    ``known`` and the branch's earlier assignments), and, apart, why any could not be
    evaluated (an error only for the caller that needs that variable). None when the file has
    no such branch. The branch ends at its chain's next elif / else / fi, so an ``if`` nested
    in it is an error rather than a misread."""
    text = path.read_text()
    header = re.compile(rf"""^[ \t]*(?:el)?if[ \t]+\[[ \t]+"?\$\{{?{re.escape(variable)}\}}?"?"""
                        rf"""[ \t]+=[ \t]+["']?{re.escape(value)}["']?[ \t]+\][ \t]*;?[ \t]*"""
                        rf"""then\b""", re.M)
    match = header.search(text)
    if match is None:
        return None
    variables, assigned, unreadable, pos = dict(known), {}, {}, match.end()
    while pos < len(text):
        skipped = SKIP.match(text, pos)
        pos = skipped.end() if skipped else pos
        where = f"{path}:{text.count(chr(10), 0, pos) + 1}"
        if pos >= len(text) or BRANCH_END.match(text, pos):
            break
        if NESTED_IF.match(text, pos):
            raise MigrationError(f"{where}: a nested if / case in the [ ${variable} = {value} ] "
                                 f"branch cannot be read; move it out of the branch")
        found = BRANCH_ASSIGNMENT.match(text, pos)
        if found is None:  # another command: not an assignment, skip its line
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
            continue
        pos = found.end()
        name, quoted, literal, word = found.groups()
        variables.pop(name, None)
        assigned.pop(name, None)
        unreadable.pop(name, None)
        if literal is None:
            try:
                literal = expand((quoted if quoted is not None else word).replace("\\\n", ""),
                                 variables, where)
            except MigrationError as err:
                unreadable[name] = str(err)
                continue
        variables[name] = assigned[name] = literal
    return assigned, unreadable
