#!/usr/bin/env bash
# Builds the lab's Debian guest from Debian packages: OUT/root.img (a raw
# ext4 file system, the guest's whole root), OUT/vmlinuz and OUT/initrd.img
# (Debian's own kernel and initramfs from inside that root).
#
# The guest: systemd, udev, qemu-guest-agent, iproute2 and a TCP echo
# service on port 7000 (systemd socket activation, one `cat` per
# connection). Its address comes from the kernel command line
# (`ferry.ip=ADDR/PREFIX`), set by the VM's spec; its root is /dev/vda.
#
# No loop device and no mount: mmdebstrap builds the tree as root in a
# directory and `mkfs.ext4 -d` writes it into the image file. The image has
# no partition table and no boot loader, so the spec boots the kernel
# directly (`firmware = "kernel"`).
#
# usage: debian-image.sh OUT [SUITE] [MIRROR]
set -euo pipefail
out=${1:?usage: debian-image.sh OUT [SUITE] [MIRROR]}
suite=${2:-bookworm}
mirror=${3:-http://deb.debian.org/debian}
size=${FERRY_DEBIAN_IMAGE_SIZE:-1536M}

command -v mmdebstrap >/dev/null || { echo "debian-image: mmdebstrap is not installed" >&2; exit 1; }
mkdir -p "$out"
tree=$(mktemp -d "$out/tree.XXXXXX")
trap 'rm -rf "$tree"' EXIT

mmdebstrap --quiet --variant=minbase \
  --include=systemd-sysv,udev,qemu-guest-agent,iproute2,procps,linux-image-amd64 \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='echo ferry-guest > "$1/etc/hostname"' \
  --customize-hook='echo "/dev/vda / ext4 defaults,errors=remount-ro 0 1" > "$1/etc/fstab"' \
  --customize-hook='chroot "$1" passwd -d root' \
  "$suite" "$tree" "deb $mirror $suite main"

# the address from the kernel command line, on the first Ethernet NIC
cat > "$tree/usr/local/sbin/ferry-net" <<'EOF'
#!/bin/sh
set -e
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    ferry.ip=*) ip=${arg#ferry.ip=} ;;
    ferry.gw=*) gw=${arg#ferry.gw=} ;;
  esac
done
[ -n "$ip" ] || exit 0
nic=$(ip -o link show | awk -F': ' '$2 != "lo" && $0 ~ /link\/ether/ {print $2; exit}')
[ -n "$nic" ] || { echo "ferry-net: no Ethernet NIC" >&2; exit 1; }
ip link set "$nic" up
ip addr add "$ip" dev "$nic"
[ -z "$gw" ] || ip route add default via "$gw"
EOF
chmod 755 "$tree/usr/local/sbin/ferry-net"
cat > "$tree/etc/systemd/system/ferry-net.service" <<'EOF'
[Unit]
Description=Guest address from the kernel command line
After=systemd-udev-settle.service sys-subsystem-net-devices-.device
Before=network-online.target
Wants=network-online.target
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/ferry-net
RemainAfterExit=yes
[Install]
WantedBy=multi-user.target
EOF
cat > "$tree/etc/systemd/system/ferry-echo.socket" <<'EOF'
[Unit]
Description=TCP echo on port 7000
[Socket]
ListenStream=7000
Accept=yes
[Install]
WantedBy=sockets.target
EOF
cat > "$tree/etc/systemd/system/ferry-echo@.service" <<'EOF'
[Unit]
Description=TCP echo connection
[Service]
ExecStart=/bin/cat
StandardInput=socket
StandardOutput=socket
EOF
ln -sf /etc/systemd/system/ferry-net.service "$tree/etc/systemd/system/multi-user.target.wants/ferry-net.service"
mkdir -p "$tree/etc/systemd/system/sockets.target.wants"
ln -sf /etc/systemd/system/ferry-echo.socket "$tree/etc/systemd/system/sockets.target.wants/ferry-echo.socket"
# a guest with nothing to wait for boots faster under emulation
for u in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer \
         systemd-networkd-wait-online.service; do
  ln -sf /dev/null "$tree/etc/systemd/system/$u"
done

cp "$tree"/boot/vmlinuz-* "$out/vmlinuz.tmp"
cp "$tree"/boot/initrd.img-* "$out/initrd.img.tmp"
rm -f "$out/root.img.tmp"
mkfs.ext4 -q -F -L ferry-root -d "$tree" "$out/root.img.tmp" "$size"
mv "$out/vmlinuz.tmp" "$out/vmlinuz"
mv "$out/initrd.img.tmp" "$out/initrd.img"
mv "$out/root.img.tmp" "$out/root.img"
echo "debian-image: $out/root.img ($(du -h --apparent-size "$out/root.img" | cut -f1), $(du -h "$out/root.img" | cut -f1) used)"
