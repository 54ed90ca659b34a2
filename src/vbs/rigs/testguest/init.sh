#!/bin/sh
# /init of the VBS test guest (busybox only). It loads the virtio and SCSI modules, reports disks
# (virtio-blk vdX, SCSI sdX on virtio-scsi) by serial as they come and go, and runs commands that the
# host sends over the serial console.
#
# Console protocol (one line each, the host strips a trailing CR):
#   guest -> host  VBS-READY
#                  VBS-DISK ADD <name> <size in bytes> <serial or ->
#                  VBS-DISK DEL <name> <serial or ->
#                  VBS-BEGIN <id> / <output lines> / VBS-END <id> <exit status>
#   host -> guest  VBS-CMD <id> <timeout in s> <base64 of a sh script>
# Output between BEGIN and END is the command's stdout+stderr followed by one extra newline, so the
# host gets the exact text back by joining those lines with "\n". Each command runs in a subshell of
# its own, so several run at once (a long writer and quick checks beside it); blocks never interleave.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Kernel messages would interleave with the protocol lines; keep only emergencies.
echo 1 > /proc/sys/kernel/printk
while read -r m; do
    insmod "/lib/modules/$m.ko" || echo "VBS-ERROR insmod $m"
done < /lib/modules/order
stty -echo < /dev/console
mkdir -p /run/disks
# A FIFO nobody writes: `read -t` on it is a sleep that forks nothing (cheap under TCG).
mkfifo /run/nap
exec 3<>/run/nap
nap() { read -t "$1" -u 3 _; }

# Both loops print to one console: whole blocks are written under this lock (busybox has no flock).
lock() { until mkdir /run/console.lock 2>/dev/null; do nap 0.01; done; }
unlock() { rmdir /run/console.lock; }
emit() { lock; echo "$*"; unlock; }

scan_disks() {
    for d in /sys/block/vd* /sys/block/sd*; do
        [ -e "$d/size" ] || continue
        n=${d##*/}
        s=
        if [ -e "$d/serial" ]; then
            read -r s 2>/dev/null < "$d/serial"
        elif [ -e "$d/device/vpd_pg80" ]; then
            # A SCSI disk's serial is its VPD page 0x80: after the page code and a length byte (the NUL
            # bytes of the header are dropped by read); a VBS serial is 20 bytes, so that byte is 0x14.
            # The page ends without a newline, so read fails though it sets s: its status is no test.
            read -r s 2>/dev/null < "$d/device/vpd_pg80"
            s=${s#??}
        fi
        [ -n "$s" ] || s=-
        if [ -e "/run/disks/$n" ]; then
            read -r old < "/run/disks/$n"
            [ "$old" = "$s" ] && continue
            # Same name, other serial: the old disk went and a new one came between two scans.
            emit "VBS-DISK DEL $n $old"
        fi
        read -r sectors < "$d/size"
        echo "$s" > "/run/disks/$n"
        emit "VBS-DISK ADD $n $((sectors * 512)) $s"
    done
    for f in /run/disks/*; do
        [ -e "$f" ] || continue
        n=${f##*/}
        if [ ! -e "/sys/block/$n" ]; then
            read -r old < "$f"
            rm -f "$f"
            emit "VBS-DISK DEL $n $old"
        fi
    done
}

scan_disks
emit VBS-READY
# Scans on the kernel's block events, not on a clock: busybox's `uevent` runs one short sh per
# event and it wakes the scanner through a FIFO. A remove event comes just before its /sys/block
# entry goes, so after an event the scanner looks again every 20 ms for half a second; one scan a
# second besides catches anything missed. (A 20 ms scan loop cost an idle guest 11 % of a host core
# under TCG, and the suite keeps several guests up at once.)
mkfifo /run/diskev
exec 4<>/run/diskev
uevent sh -c '[ "$SUBSYSTEM" = block ] && echo "$ACTION" > /run/diskev' > /dev/null 2>&1 &
while :; do
    if read -t 1 -u 4 _; then
        n=0
        while [ "$n" -lt 25 ]; do scan_disks; nap 0.02; n=$((n + 1)); done
    else
        scan_disks
    fi
done &

run_cmd() {  # <id> <timeout in s> <base64 script>
    echo "$3" | base64 -d > "/run/cmd.$1.sh"
    timeout -s KILL "$2" sh "/run/cmd.$1.sh" > "/run/cmd.$1.out" 2>&1 < /dev/null
    rc=$?
    lock
    echo "VBS-BEGIN $1"
    cat "/run/cmd.$1.out"
    echo
    echo "VBS-END $1 $rc"
    unlock
    rm -f "/run/cmd.$1.sh" "/run/cmd.$1.out"
}

while :; do
    read -r tag id limit script < /dev/console || continue
    [ "$tag" = VBS-CMD ] || continue
    case "$id:$limit" in *[!0-9:]*|:*|*:) continue ;; esac
    run_cmd "$id" "$limit" "$script" &
done
