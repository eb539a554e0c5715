"""reStructuredText (Sphinx) source -> plain prose, for the default pretraining corpus.

What is kept and what goes (rules written against the Python 3.11 documentation sources):
  kept      paragraphs, section titles, list items, definition lists, glossary entries, admonition and
            description-directive bodies (`.. function:: f(x)` keeps the signature line `f(x)` and its body),
            literal blocks (`::`), doctests and code-block bodies (as code, never inline-cleaned)
  rewritten roles (:func:`~os.path.join` -> join, :ref:`text <label>` -> text), inline literals and
            emphasis (``x`` -> x, *x* -> x), links (`text <url>`_ -> text), substitutions (|x| -> x),
            versionadded/versionchanged/deprecated -> "New in version 3.9." / "Changed in version 3.9: ..."
  dropped   heading under/overlines, link targets (.. _label:), comments, substitution definitions,
            directive options (:synopsis: ...), tables (grid, simple, list-table, csv-table), and
            directives without prose (index, toctree, module, image, include, productionlist, ...)
Directive and role syntax: https://docutils.sourceforge.io/docs/ref/rst/restructuredtext.html
"""

from __future__ import annotations

import re
import textwrap

# Directives whose whole block (argument, options, body) is dropped: they hold no prose.
DROP_DIRECTIVES = {
    "index", "toctree", "module", "currentmodule", "moduleauthor", "sectionauthor", "codeauthor",
    "highlight", "testsetup", "testcleanup", "raw", "image", "figure", "include", "literalinclude",
    "tabularcolumns", "csv-table", "list-table", "table", "productionlist", "audit-event",
    "audit-event-table", "contents", "only", "rubric", "program", "limited-api-list", "miscnews",
    "role", "default-role", "sectnum", "meta", "centered",
}  # fmt: skip
# Directives whose body is code: kept verbatim (dedented), never inline-cleaned.
CODE_DIRECTIVES = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal"}
ADMONITIONS = {
    "note": "Note", "warning": "Warning", "important": "Important", "tip": "Tip", "caution": "Caution",
    "attention": "Attention", "hint": "Hint", "danger": "Danger", "error": "Error", "seealso": "See also",
    "availability": "Availability", "impl-detail": "CPython implementation detail",
}  # fmt: skip
VERSION_NOTES = {
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}.",
    "deprecated": "Deprecated since version {}.",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}.",
}

DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:[\w-]+:)?([\w-]+)::\s*(.*)$")
EXPLICIT_MARKUP = re.compile(r"^(\s*)\.\.(\s|$)")  # comment, link target, footnote, substitution def
FOOTNOTE = re.compile(r"^(\s*)\.\.\s+\[[^\]]+\]\s+(.*)$")
OPTION = re.compile(r"^\s*:[\w-]+:")
ADORNMENT = re.compile(r"^([=\-~^*#\"'`+.:_])\1{2,}\s*$")
GRID_TABLE_BORDER = re.compile(r"^\s*\+[-=+]+\+\s*$")
SIMPLE_TABLE_BORDER = re.compile(r"^\s*=+( +=+)+\s*$")

ROLE = re.compile(r":(?:[\w-]+:)*([\w-]+):`([^`]+)`")
LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
NAMED_REF = re.compile(r"`([^`]+)`__?")
INLINE_LITERAL = re.compile(r"``(.+?)``", re.S)
STRONG = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*", re.S)
EMPHASIS = re.compile(r"(?<![\w*\\])\*(\S(?:[^*]*?\S)?)\*(?![\w*])")
INTERPRETED = re.compile(r"`([^`]+)`")
FOOTNOTE_REF = re.compile(r"\s?\[(?:#\w*|\d+|\*)\]_")
HELD = re.compile("\ue000(\\d+)\ue001")  # an inline literal set aside by clean_inline
SUBSTITUTION = re.compile(r"\|([\w][\w .-]*)\|")

Line = tuple[str, bool]  # (text, is_code)


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def role_text(role: str, content: str) -> str:
    """The visible text of a role: `title <target>` -> title; `~a.b.c` -> c; `!x` -> x; :pep:`8` -> PEP 8."""
    if role in ("pep", "rfc") and content.isdigit():
        return f"{role.upper()} {content}"
    m = re.match(r"^(.*?)\s*<[^>]*>$", content, re.S)
    if m and m.group(1):
        return m.group(1)
    if content.startswith("~"):
        return content[1:].rsplit(".", 1)[-1]
    return content.lstrip("!")


def clean_inline(line: str) -> str:
    """Inline markup -> visible text (roles, literals, emphasis, links, substitutions, footnote refs). A
    backslash escapes the character after it, except inside an inline literal, whose text is kept as written
    (``'\\n'`` stays '\\n')."""
    literals = []

    def hold(m: re.Match) -> str:  # a private-use character no markup pattern matches
        literals.append(m.group(1))
        return f"\ue000{len(literals) - 1}\ue001"

    line = INLINE_LITERAL.sub(hold, line)
    line = ROLE.sub(lambda m: role_text(m.group(1), m.group(2)), line)
    line = LINK.sub(r"\1", line)
    line = NAMED_REF.sub(r"\1", line)
    line = STRONG.sub(r"\1", line)
    line = EMPHASIS.sub(r"\1", line)
    line = INTERPRETED.sub(r"\1", line)
    line = FOOTNOTE_REF.sub("", line)
    line = SUBSTITUTION.sub(r"\1", line)
    line = line.replace("\\ ", "").replace("\\*", "*").replace("\\", "")
    return HELD.sub(
        lambda m: literals[int(m.group(1))] if int(m.group(1)) < len(literals) else m.group(0), line
    )


def take_block(lines: list[str], start: int, indent: int) -> int:
    """Index just past the block that begins at lines[start] and holds blank lines or lines indented > indent."""
    i = start
    while i < len(lines) and (not lines[i].strip() or indent_of(lines[i]) > indent):
        i += 1
    while i > start and not lines[i - 1].strip():  # trailing blank lines belong to what follows
        i -= 1
    return i


def dedent(lines: list[str]) -> list[str]:
    return textwrap.dedent("\n".join(lines)).split("\n")


def code(lines: list[str]) -> list[Line]:
    return [(line, True) for line in lines]


def prose(lines: list[str]) -> list[Line]:
    return [(line, False) for line in lines]


def directive_text(name: str, argument: str, block: list[str]) -> list[Line]:
    """Plain-text lines for one directive: its argument/signature lines, then its cleaned body."""
    head, body, in_head = [argument] if argument else [], [], True
    for line in block:
        if in_head and not line.strip():
            in_head = False
            continue
        if in_head and OPTION.match(line):
            continue
        (head if in_head else body).append(line)
    head = [h.strip() for h in head]
    if name in CODE_DIRECTIVES:
        return code(dedent(body or head))
    body_lines = clean_lines(dedent(body)) if body else []
    if name in VERSION_NOTES:
        n = 2 if name == "deprecated-removed" else 1
        words = " ".join(head).split(" ", n)
        note = VERSION_NOTES[name].format(*(words + ["?", "?"])[:n])
        rest = " ".join(words[n:]).strip()
        if rest or body_lines:
            note = note[:-1] + ": " + rest
        return prose([note.rstrip()]) + body_lines
    if name in ADMONITIONS:
        return prose([f"{ADMONITIONS[name]}: {' '.join(head)}".rstrip()]) + body_lines
    # description directives (function, class, method, data, c:function, opcode, ...) and unknown ones:
    # the signature lines, a blank line, the body.
    return prose(head + ([""] if head and body_lines else [])) + body_lines


def clean_lines(lines: list[str]) -> list[Line]:
    """reST lines -> (line, is_code) pairs, block markup removed; inline markup is left for `clean_rst`."""
    out: list[Line] = []
    i, literal_after, literal_indent = 0, False, 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        ind = indent_of(line)
        if not stripped:
            out.append(("", False))
            i += 1
            continue
        if literal_after and out and ind > literal_indent:  # the literal block after a `::` paragraph
            end = take_block(lines, i, literal_indent)
            out.extend(code(dedent(lines[i:end])))
            literal_after, i = False, end
            continue
        literal_after = False
        m = DIRECTIVE.match(line)
        if m:
            end = take_block(lines, i + 1, ind)
            name = m.group(2)
            if name not in DROP_DIRECTIVES:
                out.extend(directive_text(name, m.group(3).strip(), lines[i + 1 : end]))
            i = end
            continue
        m = FOOTNOTE.match(line)
        if m:
            end = take_block(lines, i + 1, ind)
            out.extend(clean_lines([m.group(2)] + dedent(lines[i + 1 : end])))
            i = end
            continue
        if EXPLICIT_MARKUP.match(line):  # comment, link target, substitution definition: no prose
            i = take_block(lines, i + 1, ind)
            continue
        if GRID_TABLE_BORDER.match(line):
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        if SIMPLE_TABLE_BORDER.match(line):
            i += 1
            while i < len(lines) and not (
                SIMPLE_TABLE_BORDER.match(lines[i]) and (i + 1 == len(lines) or not lines[i + 1].strip())
            ):
                i += 1
            i += 1
            continue
        if ADORNMENT.match(stripped) and ind == 0:  # section title under/overline
            i += 1
            continue
        if stripped.startswith(">>>"):  # doctest block: code, kept as is up to the next blank line
            while i < len(lines) and lines[i].strip():
                out.append((lines[i], True))
                i += 1
            continue
        if stripped.endswith("::"):  # `Example::` -> `Example:`, and the next indented block is literal
            literal_after, literal_indent = True, ind
            text = stripped[:-2].rstrip()
            if text:
                out.append((" " * ind + text + ("" if text.endswith(":") else ":"), False))
            i += 1
            continue
        out.append((line.rstrip(), False))
        i += 1
    return out


def clean_rst(text: str) -> str:
    """reST source -> plain text: markup removed, at most one blank line in a row, stripped."""
    lines = clean_lines(text.replace("\t", "        ").split("\n"))
    # inline markup may span line breaks: clean each run of prose lines (a paragraph) as one string
    parts, run = [], []
    for line, is_code in lines + [("", True)]:
        if is_code or not line.strip():
            if run:
                parts.append(clean_inline("\n".join(run)))
                run = []
            parts.append(line)
        else:
            run.append(line)
    text = "\n".join(part.rstrip() for part in parts[:-1])
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def split_sections(text: str) -> list[str]:
    """Split reST source at its section titles (a title line underlined at column 0); each part
    starts with its title (and overline, if any)."""
    lines = text.split("\n")
    starts = [0]
    for i in range(1, len(lines)):
        under, title = lines[i], lines[i - 1]
        if (
            ADORNMENT.match(under)
            and title.strip()
            and not title.startswith(" ")
            and not ADORNMENT.match(title)
            and len(under.rstrip()) >= len(title.rstrip())
        ):
            start = i - 2 if i >= 2 and ADORNMENT.match(lines[i - 2]) else i - 1
            if start > starts[-1]:
                starts.append(start)
    return ["\n".join(lines[a:b]) for a, b in zip(starts, starts[1:] + [len(lines)])]
