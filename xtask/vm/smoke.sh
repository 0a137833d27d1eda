#!/bin/sh
# memprobe's smoke suite: run inside each kernel booted under qemu (as part
# of /init) and on the host's own kernel. It only runs things and prints
# what they said, in sections ("@@ NAME" ... "@@ end"); `cargo xtask test`
# judges them (xtask/src/kernels/checks.rs).
#   SMOKE_BIN: the folder with memprobe and the sites fixture
#   SMOKE_OUT: a scratch folder, emptied first
BIN=${SMOKE_BIN:-/smoke}
OUT=${SMOKE_OUT:-/tmp/smoke}
M="$BIN/memprobe"
rm -rf "$OUT" && mkdir -p "$OUT"

section() { echo "@@ $1"; }
end() { echo "@@ end"; }

# Waits up to $3 seconds for the text $2 in file $1.
wait_for() {
    i=0
    while ! grep -q "$2" "$1" 2>/dev/null; do
        i=$((i + 1))
        [ "$i" -gt $(($3 * 10)) ] && return 1
        sleep 0.1
    done
}

# Starts the sites fixture reading its commands from fd 3; sets SITES_PID.
start_sites() {
    rm -f "$OUT/ctl" "$OUT/sites.out"
    mkfifo "$OUT/ctl"
    "$BIN/sites" <"$OUT/ctl" >"$OUT/sites.out" &
    exec 3>"$OUT/ctl"
    wait_for "$OUT/sites.out" ready 60
    SITES_PID=$(sed -n 's/^ready //p' "$OUT/sites.out")
}

# The report of a run's first profile, by bytes and by objects.
report() {
    heap=$(ls "$OUT/$1"/memprobe.*.0.heap 2>/dev/null | head -n 1)
    section "$1-report-space"
    [ -n "$heap" ] && "$M" report --measure inuse-space "$heap" 2>&1
    end
    section "$1-report-objects"
    [ -n "$heap" ] && "$M" report --measure inuse-objects "$heap" 2>&1
    end
}

our_programs() {
    bpftool prog show 2>&1 | grep -E 'name (alloc_|free_arg0|own_sample|call_return|resize_|session_|mmap_|process_exit|thread_exit)'
}

# Default mode, attached to a running process, stopped with Ctrl-C.
# --verbose: a fallback from uprobe sessions is said there once.
# --windows 10s/11s: the window opened at the attach stays open past the
# burst, every call probed (the windows' programs loaded all the same). At the
# defaults a guest's trap (some 10 us under TCG) is dear enough that the
# first judgement narrows the burst, on a slow host before it ends, and
# the sites it allocates after that are weighed by windows that a burst of
# two seconds rarely gets (keep_4k read 22% to 85% short on such a host):
# the windows' accuracy is the host tests', this check is the kernel's.
WINDOW_OPEN="--windows 10s/11s"
start_sites
"$M" --pid "$SITES_PID" --sample-interval 4096 $WINDOW_OPEN --verbose --output "$OUT/attach" 2>"$OUT/attach.err" &
MP=$!
wait_for "$OUT/attach.err" "memprobe: attached" 120
section attached-programs; our_programs; end
echo go >&3
wait_for "$OUT/sites.out" done 300
kill -INT "$MP"
wait "$MP"
status=$?
section attach; echo "exit $status"; cat "$OUT/attach.err"; end
echo end >&3
exec 3>&-
wait
report attach

# The process exits mid-run: memprobe writes its profile and ends then.
start_sites
"$M" --pid "$SITES_PID" --duration 10m --sample-interval 4096 $WINDOW_OPEN --output "$OUT/exit" 2>"$OUT/exit.err" &
MP=$!
wait_for "$OUT/exit.err" "memprobe: attached" 120
echo go >&3
wait_for "$OUT/sites.out" done 300
echo end >&3
exec 3>&-
ENDED=0
while kill -0 "$MP" 2>/dev/null && [ "$ENDED" -lt 300 ]; do
    sleep 0.1
    ENDED=$((ENDED + 1))
done
kill -0 "$MP" 2>/dev/null && kill -KILL "$MP"
wait "$MP"
status=$?
section exit; echo "exit $status"; echo "tenths-after-target-exit $ENDED"; cat "$OUT/exit.err"; end
wait
report exit

# Sampling in windows: malloc probed in short windows only; the 1 MiB
# site is on jemalloc's slow path whenever it allocates.
start_sites
"$M" --pid "$SITES_PID" --sampling windows --windows 50ms/500ms --sample-interval 4096 --output "$OUT/windows" 2>"$OUT/windows.err" &
MP=$!
wait_for "$OUT/windows.err" "memprobe: attached" 120
echo go >&3
wait_for "$OUT/sites.out" done 300
sleep 1
kill -INT "$MP"
wait "$MP"
status=$?
section windows; echo "exit $status"; cat "$OUT/windows.err"; end
echo end >&3
exec 3>&-
wait
report windows

# Launch mode: the command runs with the probes already in place.
echo go | "$M" --sample-interval 4096 --output "$OUT/launch" -- "$BIN/sites" >/dev/null 2>"$OUT/launch.err"
status=$?
section launch; echo "exit $status"; cat "$OUT/launch.err"; end
report launch

# Sessions asked for by name: an error naming the feature where the kernel
# has none, a normal run where it has them.
start_sites
"$M" --pid "$SITES_PID" --return-probes sessions --duration 1s --output "$OUT/sessions" 2>"$OUT/sessions.err"
status=$?
section sessions; echo "exit $status"; cat "$OUT/sessions.err"; end
echo go >&3
echo end >&3
exec 3>&-
wait

# The kernel frees programs a moment after their last fd closes.
i=0
while our_programs | grep -q . && [ "$i" -lt 100 ]; do
    sleep 0.1
    i=$((i + 1))
done
section programs-left; our_programs; end
section links-left; bpftool link show 2>&1; end
section smoke-done; end
