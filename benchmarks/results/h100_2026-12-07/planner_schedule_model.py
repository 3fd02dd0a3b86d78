"""A model of the d-128 planner warpgroup's schedule on port/prefill-copier (131c7a5, fixed in fcf9830).

Warp pw (0..3) plans the chunks c = pw (mod 4): chunk pw before the loop, and chunk pw + 4's meta words loaded there
too; in step ci it does the phase (ci - pw) & 3 of its next chunk: 0 publishes chunk ci + 4's plans, 1 loads chunk
ci + 7's page ids, 2 loads chunk ci + 6's meta words from them. Every chunk c >= 4 must be planned in step c - 4 from
words loaded for c from c's own page ids. Run: python planner_schedule_model.py (prints the chunk counts that break).
"""


def errors(chunks: int, fixed: bool) -> list:
    found = []
    for pw in range(4):
        words, page, planned = None, None, {}
        if pw < chunks:
            planned[pw] = ("prologue", None)
        if pw + 4 < chunks:
            words = (pw + 4, "ok")
        for ci in range(chunks):
            phase = (ci - pw) & 3
            if phase == 0 and ci + 4 < chunks:
                planned[ci + 4] = (ci, words)
            elif phase == 1 and (not fixed or ci + 7 >= 8):
                page = ci + 7 if ci + 7 < chunks else None
            elif phase == 2 and (not fixed or ci + 6 >= 8) and ci + 6 < chunks:
                words = (ci + 6, "ok" if page == ci + 6 else "from a page id never loaded")
        for c in range(pw, chunks, 4):
            if c not in planned:
                found.append((pw, c, "never planned"))
            elif c >= 4 and planned[c] != (c - 4, (c, "ok")):
                found.append((pw, c, planned[c]))
    return found


if __name__ == "__main__":
    for fixed in (False, True):
        bad = {n: e for n in range(80) if (e := errors(n, fixed))}
        label = "fcf9830 (fixed)" if fixed else "131c7a5 (as call 6 ran it)"
        print(f"{label}: {len(bad)} of 80 chunk counts break; first: {next(iter(bad.items()), None)}")
