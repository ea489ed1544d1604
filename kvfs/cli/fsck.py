"""fsck.kvfs: offline check (and repair) of a kvfs device."""
import sys

from ..fsck import check
from . import Parser, tool


@tool("fsck.kvfs")
def main(argv):
    p = Parser(prog="fsck.kvfs", description="Check a kvfs device that is not mounted. Exit 0 when "
               "clean, 1 when problems were found (or remain after --repair).")
    p.add_argument("--repair", action="store_true",
                   help="make the store consistent: drop what cannot be trusted, keep the rest")
    p.add_argument("--no-data", action="store_true", help="skip reading back and verifying every block")
    p.add_argument("device")
    args = p.parse_args(argv)
    report = check(args.device, repair=args.repair, verify_data=not args.no_data)
    for note in report.notes:
        print(f"note: {note}")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    for repair in report.repairs:
        print(f"repaired: {repair}")
    if report.repairs:
        after = check(args.device)
        if not after.clean:
            for problem in after.problems:
                print(f"STILL BROKEN: {problem}")
            return 1
        print(f"{args.device}: repaired; the store now checks clean")
        return 0
    if report.clean:
        print(f"{args.device}: clean")
        return 0
    print(f"{args.device}: {len(report.problems)} problem(s); run fsck.kvfs --repair to fix")
    return 1


if __name__ == "__main__":
    sys.exit(main())
