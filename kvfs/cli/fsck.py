"""fsck.kvfs: offline check (and repair) of a kvfs device."""
import sys

from ..server.fsck import check
from . import Parser, tool
from .progress import Progress


@tool("fsck.kvfs")
def main(argv):
    p = Parser(prog="fsck.kvfs", description="Check a kvfs device that is not mounted. Exit 0 when "
               "clean (or clean after --repair), 1 when problems were found (or remain after --repair). "
               "Output lines start with note:, PROBLEM:, repaired:, lost: or STILL BROKEN:; the last "
               "line is the verdict. Errors are one line on stderr.")
    p.add_argument("--repair", action="store_true",
                   help="make the store consistent: drop what cannot be trusted, keep the rest")
    p.add_argument("--no-data", action="store_true", help="skip reading back and verifying every block")
    p.add_argument("--force", action="store_true",
                   help="check (or repair) even a store whose multi-mount protection record shows a "
                        "live owner on another host")
    p.add_argument("device")
    args = p.parse_args(argv)
    progress = Progress("verifying blocks")
    try:
        report = check(args.device, repair=args.repair, verify_data=not args.no_data, progress=progress,
                       force=args.force)
    finally:
        progress.close()
    print_report(report)
    if report.repairs:
        after = check(args.device)
        if not after.clean:
            for problem in after.problems:
                print(f"STILL BROKEN: {problem}")
            return 1
        if report.lost:
            print(f"{args.device}: repaired with losses (see 'lost:' above); the store now checks clean")
        else:
            print(f"{args.device}: repaired; the store now checks clean")
        return 0
    if report.clean:
        print(f"{args.device}: clean")
        return 0
    print(f"{args.device}: {len(report.problems)} problem(s); run fsck.kvfs --repair to fix")
    return 1


def print_report(report):
    """The one output format: every line on stdout starts with its kind.

    ``note:`` information (journal replay, warnings of the loader and the
    layers), ``PROBLEM:`` an inconsistency, ``repaired:`` what --repair did,
    ``lost:`` what --repair could not recover, ``STILL BROKEN:`` a problem the
    re-check after a repair still finds; the last line is the verdict.
    """
    for prefix, lines in (("note", report.notes), ("PROBLEM", report.problems),
                          ("repaired", report.repairs), ("lost", report.lost)):
        for line in lines:
            print(f"{prefix}: {line}")


if __name__ == "__main__":
    sys.exit(main())
