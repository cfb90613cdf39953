#!/usr/bin/env python3
# SASS of a cubin's kernels on a machine without a GPU driver, and a summary of their main loops.
#
# The CUDA 13 toolkit on the development machine has no cuobjdump or nvdisasm, and Debian's
# nvidia-cuda-toolkit 11.8 (non-free) cannot read CUDA 13's ELF header. Its nvdisasm does decode
# sm_90a instructions once the header carries the older flags (EF_CUDA_SM90, virtual SM 90, OSABI
# 0x33). To get it:
#   echo 'Types: deb
#   URIs: http://deb.debian.org/debian
#   Suites: bookworm
#   Components: non-free
#   Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' > /etc/apt/sources.list.d/non-free.sources
#   apt-get update && cd /tmp && apt-get download nvidia-cuda-toolkit && dpkg -x nvidia-cuda-toolkit_*.deb nvtk
# then NVDISASM=/tmp/nvtk/usr/bin/nvdisasm (the default). Checked against cuobjdump 13.0 on the device:
# the same instructions at the same addresses.
#
#   usage: sass_loops.py FILE.cubin [KERNEL_REGEX] [--raw]
#   cubin: nvcc ... -gencode=arch=compute_90a,code=sm_90a -cubin tests/cuda/wgmma_kernels.cu -o k.cubin
# For every kernel whose mangled name matches, each loop (a backward branch) that holds wgmma products
# (HGMMA), with counts of what a main loop spends on besides its products: convergence regions
# (BSSY/BSYNC: ptxas puts one around a branch it cannot prove warp-uniform), warp votes, branches,
# MUFU, shuffles and wgmma waits. Check a kernel edit with it and `-Xptxas -v` (C7511: serialized
# products) before spending device time on it.
import os, re, struct, subprocess, sys, tempfile

args = [a for a in sys.argv[1:] if not a.startswith('--')]
if not args:
    sys.exit('usage: sass_loops.py FILE.cubin [KERNEL_REGEX] [--raw]')
data = bytearray(open(args[0], 'rb').read())
# The SM the cubin is for: CUDA 13 (OSABI 0x41) keeps it in e_flags' second byte, older toolkits in
# the first. Only sm_90(a) is rewritten: another SM's code would be decoded as sm_90's.
flags = struct.unpack_from('<I', data, 48)[0]
sm = (flags >> 8) & 0xFF if data[7] == 0x41 else flags & 0xFF
if sm != 90:
    sys.exit(f'sass_loops.py: {args[0]} is for SM {sm}, not 90: this header rewrite reads sm_90(a) only')
data[7] = 0x33                                  # ELF OSABI: CUDA
data[8] = 7                                     # ABI version
struct.pack_into('<I', data, 48, 0x005A055A)    # e_flags: SM 90, virtual SM 90, 64-bit addresses, unified textures
with tempfile.NamedTemporaryFile(suffix='.cubin', delete=False) as f:
    f.write(data)
try:
    run = subprocess.run([os.environ.get('NVDISASM', '/tmp/nvtk/usr/bin/nvdisasm'), '-c', f.name], capture_output=True, text=True)
finally:
    os.unlink(f.name)
if run.returncode != 0:
    sys.exit(f'sass_loops.py: nvdisasm failed: {run.stderr.strip()}')
text = run.stdout
if '--raw' in sys.argv:
    print(text)
    sys.exit()

for function in re.split(r"\n//-+ \.text\.", text)[1:]:
    name = function.split(' ', 1)[0]
    if len(args) > 1 and not re.search(args[1], name):
        continue
    instructions, labels, pending = [], {}, []
    for line in function.split('\n'):
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            for l in pending:
                labels[l] = address
            pending = []
            instructions.append((address, m.group(2).strip()))
    instructions = [(a, re.sub(r"`?\(?(\.L_x_\d+)\)?", lambda m: hex(labels.get(m.group(1), 1 << 40)), t)) for a, t in instructions]
    print(f'== {name} ({len(instructions)} instructions)')
    # The barrier waits' retry blocks sit after the last EXIT and branch back into the body: not loops.
    last_exit = max((a for a, t in instructions if re.search(r"\bEXIT\b", t)), default=0)
    for address, text_ in instructions:
        target = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text_)
        if not target or int(target.group(1), 16) >= address or address > last_exit:
            continue
        body = [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
        count = lambda key: sum(key in t for t in body)
        if count('HGMMA'):
            print(f"  loop {target.group(1)}-{address:#x}: {len(body)} instructions, HGMMA {count('HGMMA')}, BSSY {count('BSSY')}, "
                  f"BSYNC {count('BSYNC')}, VOTE {count('VOTE')}, BRA {count('BRA')}, MUFU {count('MUFU')}, SHFL {count('SHFL')}, "
                  f"wgmma waits {count('WARPGROUP.DEPBAR')}")
