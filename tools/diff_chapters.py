"""What a chapter changes against its base: `diff -u BASE/train_llm.py CHAPTER/train_llm.py`, without the definitions
the chapter copies byte for byte from another chapter (tests/test_drift.py's COPIES, which that test keeps identical
to their sources) and its base does not have. For chapter 11 that leaves its own changes to chapter 07: the pipeline
it takes from chapter 08 and the split attention it takes from chapter 09 are left out, and named on stderr.

    python tools/diff_chapters.py 07 11
    python tools/diff_chapters.py 07 11 --keep-copies    # the whole diff, as diff -u prints it
"""

import argparse
import ast
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description="diff -u of two chapters' train_llm.py, without the definitions "
                                                 "the second copies unchanged from other chapters.")
    group = parser.add_argument_group("chapters")
    group.add_argument("base", help="the base chapter's number, e.g. 07")
    group.add_argument("chapter", help="the chapter's number, e.g. 11")
    group = parser.add_argument_group("output")
    group.add_argument("--keep-copies", action="store_true", help="show the copied definitions too")
    group.add_argument("-U", "--context", type=int, default=3, help="lines of context around each change")
    args = parser.parse_args()
    base, chapter = chapter_script(args.base), chapter_script(args.chapter)
    # NOTE: a copy of a definition the base has too (chapter 08's save_checkpoint in chapter 11) stays: its change
    # from the base is part of the chapter's diff.
    _, in_base = without_definitions(base.read_text(), [name for names in read_copies().values() for name in names])
    copies = [] if args.keep_copies else [name for (_, copier), names in read_copies().items()
                                          if copier == args.chapter for name in names if name not in in_base]
    chapter_lines, left_out = without_definitions(chapter.read_text(), copies)
    if left_out:
        print(f"left out, copied unchanged from another chapter: {', '.join(left_out)}", file=sys.stderr)
    sys.stdout.writelines(difflib.unified_diff(base.read_text().splitlines(keepends=True), chapter_lines,
                                               str(base.relative_to(REPO)), str(chapter.relative_to(REPO)),
                                               n=args.context))


def chapter_script(number):
    found = sorted(REPO.glob(f"{number}-*/train_llm.py"))
    if not found:
        raise SystemExit(f"error: no chapter {number} (a folder {number}-*/ with train_llm.py)")
    return found[0]


def read_copies():
    """tests/test_drift.py's COPIES, read from its source (the tool needs no pytest)."""
    for node in ast.parse((REPO / "tests" / "test_drift.py").read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["COPIES"]:
            return ast.literal_eval(node.value)
    raise SystemExit("error: tests/test_drift.py has no COPIES")


def without_definitions(source, names):
    """The source's lines without the named top-level definitions (with the comment lines right above each) and the
    named comment blocks (a section's title), each with the blank lines after it; and the names found."""
    lines = source.splitlines(keepends=True)
    dropped, found = set(), []
    for node in ast.parse(source).body:
        name = getattr(node, "name", None) or next((target.id for target in getattr(node, "targets", [])
                                                    if isinstance(target, ast.Name)), None)
        if name in names:
            first = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
            while first > 1 and lines[first - 2].lstrip().startswith("#"):
                first -= 1
            dropped.update(range(first - 1, node.end_lineno))
            found.append(name)
    for index, line in enumerate(lines):
        if line.strip() in names and line.startswith("#"):
            dropped.add(index)
            found.append(line.strip())
    for index in sorted(dropped):
        following = index + 1
        while following < len(lines) and not lines[following].strip() and following not in dropped:
            dropped.add(following)
            following += 1
    return [line for index, line in enumerate(lines) if index not in dropped], found


if __name__ == "__main__":
    main()
