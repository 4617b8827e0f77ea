#!/usr/bin/env bash
# Builds the lab's Debian guest from Debian packages: OUT/disk.img, a raw
# disk that SeaBIOS or OVMF boots like any cloud image (an MBR; a FAT boot
# partition with SYSLINUX, Debian's kernel and initramfs, and the same as a
# unified kernel image at \EFI\BOOT\BOOTX64.EFI; an ext4 root partition), and
# OUT/vmlinuz and OUT/initrd.img for a direct kernel boot
# (root=LABEL=ferry-root).
#
# The guest: systemd, udev, qemu-guest-agent, iproute2 and a TCP echo
# service on port 7000 (systemd socket activation, one `cat` per
# connection). Its address: `ferry.ip=ADDR/PREFIX` on the kernel command
# line, else the first address in the `network-config` of a cloud-init
# NoCloud seed (a CD-ROM labelled `cidata`, which the VM's spec attaches),
# read without cloud-init itself.
#
# No loop device and no mount: mmdebstrap builds the tree in a directory,
# `mkfs.ext4 -d` writes it into a file system image, mtools and
# `syslinux --install` make the boot partition in a file, and dd places
# both behind an MBR that sfdisk writes into the disk file.
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
  --customize-hook='echo "LABEL=ferry-root / ext4 defaults,errors=remount-ro 0 1" > "$1/etc/fstab"' \
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
if [ -z "$ip" ]; then
  # a cloud-init NoCloud seed: the first ADDRESS/PREFIX of its network-config
  seed=$(blkid -L cidata 2>/dev/null || true)
  [ -n "$seed" ] || exit 0
  mkdir -p /run/ferry-seed
  mount -o ro "$seed" /run/ferry-seed
  ip=$(grep -oE '[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+/[0-9]+' /run/ferry-seed/network-config 2>/dev/null | head -1 || true)
  umount /run/ferry-seed
  [ -n "$ip" ] || exit 0
fi
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

for t in syslinux mcopy mmd mkfs.vfat sfdisk objcopy; do
  command -v $t >/dev/null || { echo "debian-image: $t is not installed (packages syslinux, mtools, dosfstools, fdisk, binutils)" >&2; exit 1; }
done
cp "$tree"/boot/vmlinuz-* "$out/vmlinuz.tmp"
cp "$tree"/boot/initrd.img-* "$out/initrd.img.tmp"

# the root file system
rm -f "$out/root.fs"
mkfs.ext4 -q -F -L ferry-root -d "$tree" "$out/root.fs" "$size"

# the boot partition: FAT16 with SYSLINUX, the kernel and the initramfs
rm -f "$out/boot.fs"
boot_mib=128
mkfs.vfat -F 16 -n FERRYBOOT -C "$out/boot.fs" $((boot_mib * 1024)) >/dev/null
cat > "$out/syslinux.cfg" <<'CFG'
SERIAL 0 115200
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND console=ttyS0 root=LABEL=ferry-root rw quiet
CFG
export MTOOLS_SKIP_CHECK=1
mcopy -i "$out/boot.fs" "$out/vmlinuz.tmp" ::vmlinuz
mcopy -i "$out/boot.fs" "$out/initrd.img.tmp" ::initrd.img
mcopy -i "$out/boot.fs" "$out/syslinux.cfg" ::syslinux.cfg
# UEFI: the same kernel, initramfs and command line as one EFI program (a
# unified kernel image on systemd-boot's stub), where OVMF looks on any
# disk: \EFI\BOOT\BOOTX64.EFI
stub=/usr/lib/systemd/boot/efi/linuxx64.efi.stub
[ -f "$stub" ] || { echo "debian-image: $stub is missing (package systemd-boot-efi)" >&2; exit 1; }
printf 'console=ttyS0 root=LABEL=ferry-root rw quiet' > "$out/cmdline.txt"
objcopy \
  --add-section .osrel="$tree/usr/lib/os-release" --change-section-vma .osrel=0x20000 \
  --add-section .cmdline="$out/cmdline.txt" --change-section-vma .cmdline=0x30000 \
  --add-section .linux="$out/vmlinuz.tmp" --change-section-vma .linux=0x2000000 \
  --add-section .initrd="$out/initrd.img.tmp" --change-section-vma .initrd=0x4000000 \
  "$stub" "$out/BOOTX64.EFI"
mmd -i "$out/boot.fs" ::EFI ::EFI/BOOT
mcopy -i "$out/boot.fs" "$out/BOOTX64.EFI" ::EFI/BOOT/BOOTX64.EFI
rm -f "$out/BOOTX64.EFI" "$out/cmdline.txt"
syslinux --install "$out/boot.fs"

# the disk: MBR (SYSLINUX's boot code), partition 1 boot (active), 2 root
boot_start=2048
boot_sectors=$((boot_mib * 2048))
root_start=$((boot_start + boot_sectors))
root_sectors=$(( $(stat -c %s "$out/root.fs") / 512 ))
rm -f "$out/disk.img.tmp"
truncate -s $(( (root_start + root_sectors) * 512 )) "$out/disk.img.tmp"
sfdisk -q "$out/disk.img.tmp" <<TABLE
label: dos
start=$boot_start, size=$boot_sectors, type=e, bootable
start=$root_start, size=$root_sectors, type=83
TABLE
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$out/disk.img.tmp" bs=440 count=1 conv=notrunc status=none
dd if="$out/boot.fs" of="$out/disk.img.tmp" bs=512 seek=$boot_start conv=notrunc,sparse status=none
dd if="$out/root.fs" of="$out/disk.img.tmp" bs=1M seek=$((root_start / 2048)) conv=notrunc,sparse status=none
rm -f "$out/root.fs" "$out/boot.fs" "$out/syslinux.cfg"
mv "$out/vmlinuz.tmp" "$out/vmlinuz"
mv "$out/initrd.img.tmp" "$out/initrd.img"
mv "$out/disk.img.tmp" "$out/disk.img"
echo "debian-image: $out/disk.img ($(du -h --apparent-size "$out/disk.img" | cut -f1), $(du -h "$out/disk.img" | cut -f1) used)"
