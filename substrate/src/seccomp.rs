//! Seccomp filters, read and run the way the kernel runs them, with no system call.
//!
//! A program that installs a seccomp filter (OpenSSH's pre-authentication child, systemd's
//! `SystemCallFilter=`, browsers) tells the kernel which system calls each of its threads may
//! make; anything else gets the thread or the whole process killed (`SIGSYS`), or an error.
//! The layer makes system calls on the program's behalf (frames, acknowledgements, bells), so
//! it must know, before it makes one, whether the program's filters let it through. The layer
//! sees every filter the program installs through libc (`prctl(PR_SET_SECCOMP)`, `seccomp(2)`
//! through `syscall`), keeps a copy, and asks [`Filter::run`] about each call it would make,
//! with the arguments it would pass.
//!
//! The program is classic BPF as the kernel accepts it for seccomp ([`Filter::parse`] checks
//! what `seccomp_check_filter` and `bpf_check_classic` check: known opcodes only, jumps
//! forward and inside the program, loads of aligned 32-bit words of [`SeccompData`], scratch
//! memory in range, a return at the end), run over a [`SeccompData`] built from the call.

/// `AUDIT_ARCH_X86_64`: the architecture word of a native x86-64 system call.
pub const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
/// `AUDIT_ARCH_AARCH64`.
pub const AUDIT_ARCH_AARCH64: u32 = 0xC000_00B7;

/// Longest program the kernel accepts (`BPF_MAXINSNS`).
pub const MAX_INSNS: usize = 4096;
/// Size of one instruction as the program passes it (`struct sock_filter`).
pub const INSN_LEN: usize = 8;
/// Size of `struct seccomp_data`.
pub const DATA_LEN: u32 = 64;

/// The kernel's actions (`SECCOMP_RET_*`, the upper 16 bits of a filter's answer).
pub mod ret {
    /// Kill the whole process.
    pub const KILL_PROCESS: u32 = 0x8000_0000;
    /// Kill the calling thread.
    pub const KILL_THREAD: u32 = 0x0000_0000;
    /// Send `SIGSYS` to the thread.
    pub const TRAP: u32 = 0x0003_0000;
    /// Fail with the errno in the low 16 bits.
    pub const ERRNO: u32 = 0x0005_0000;
    /// Ask a supervisor process.
    pub const USER_NOTIF: u32 = 0x7fc0_0000;
    /// Ask a ptrace tracer (fails with `ENOSYS` without one).
    pub const TRACE: u32 = 0x7ff0_0000;
    /// Allow, and log.
    pub const LOG: u32 = 0x7ffc_0000;
    /// Allow.
    pub const ALLOW: u32 = 0x7fff_0000;
    /// The action part of an answer.
    pub const ACTION_FULL: u32 = 0xffff_0000;
}

/// What a filter (or a stack of filters) does with one system call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The call goes to the kernel (`ALLOW` or `LOG`).
    Allow,
    /// The call fails with this errno and nothing else happens.
    Errno(u16),
    /// The thread or the process dies, gets `SIGSYS`, or depends on another process
    /// (`KILL_*`, `TRAP`, `TRACE`, `USER_NOTIF`): never something the layer may cause.
    Deny,
}

impl Verdict {
    /// The verdict for a filter's 32-bit answer.
    pub fn of(answer: u32) -> Verdict {
        match answer & ret::ACTION_FULL {
            ret::ALLOW | ret::LOG => Verdict::Allow,
            ret::ERRNO => Verdict::Errno((answer & 0xffff) as u16),
            _ => Verdict::Deny,
        }
    }

    /// The kernel's precedence: the most restrictive action of a stack of filters wins
    /// (compared as signed action values, so that `KILL_PROCESS` is the strongest).
    pub fn combine(answers: impl IntoIterator<Item = u32>) -> Option<u32> {
        answers.into_iter().min_by_key(|a| (a & ret::ACTION_FULL) as i32)
    }
}

/// The input of a filter: what the kernel knows of a system call (`struct seccomp_data`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeccompData {
    /// System call number.
    pub nr: i32,
    /// `AUDIT_ARCH_*` of the calling convention.
    pub arch: u32,
    /// Address of the calling instruction (the layer cannot know it in advance: 0).
    pub instruction_pointer: u64,
    /// The six arguments.
    pub args: [u64; 6],
}

impl SeccompData {
    /// A call of this machine's architecture.
    pub fn native(nr: i64, args: [u64; 6]) -> SeccompData {
        SeccompData { nr: nr as i32, arch: native_arch(), instruction_pointer: 0, args }
    }

    /// The 32-bit word at byte offset `off` (aligned, inside the structure), in this
    /// machine's byte order, as the kernel's `BPF_LD|BPF_W|BPF_ABS` loads it.
    fn word(&self, off: u32) -> u32 {
        let pick = |v: u64, high: bool| {
            let (lo, hi) = (v as u32, (v >> 32) as u32);
            if high == cfg!(target_endian = "little") {
                hi
            } else {
                lo
            }
        };
        match off {
            0 => self.nr as u32,
            4 => self.arch,
            8 | 12 => pick(self.instruction_pointer, off == 12),
            16..=60 => {
                let i = ((off - 16) / 8) as usize;
                pick(self.args[i], off % 8 == 4)
            }
            _ => 0,
        }
    }
}

/// This machine's `AUDIT_ARCH_*`.
pub fn native_arch() -> u32 {
    if cfg!(target_arch = "aarch64") {
        AUDIT_ARCH_AARCH64
    } else {
        AUDIT_ARCH_X86_64
    }
}

/// Why a program is not a filter the kernel would accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterError {
    /// No instruction, more than [`MAX_INSNS`], or a length that is not whole instructions.
    Length(usize),
    /// An opcode seccomp does not allow, at this index.
    Opcode(usize, u16),
    /// A jump past the end of the program, at this index.
    Jump(usize),
    /// A load outside `struct seccomp_data` or not 4-byte aligned, at this index.
    Load(usize),
    /// Scratch memory index out of range, at this index.
    Scratch(usize),
    /// A division or modulo by the constant zero, at this index.
    DivZero(usize),
    /// The last instruction is not a return.
    NoReturn,
}

impl std::fmt::Display for FilterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FilterError::Length(n) => write!(f, "bad program length {n}"),
            FilterError::Opcode(i, c) => write!(f, "instruction {i}: opcode {c:#06x} not allowed"),
            FilterError::Jump(i) => write!(f, "instruction {i}: jump out of the program"),
            FilterError::Load(i) => write!(f, "instruction {i}: load outside seccomp_data"),
            FilterError::Scratch(i) => write!(f, "instruction {i}: scratch index out of range"),
            FilterError::DivZero(i) => write!(f, "instruction {i}: division by zero"),
            FilterError::NoReturn => write!(f, "the program does not end with a return"),
        }
    }
}

/// One classic BPF instruction (`struct sock_filter`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    /// Opcode.
    pub code: u16,
    /// Jump offset if true.
    pub jt: u8,
    /// Jump offset if false.
    pub jf: u8,
    /// Constant.
    pub k: u32,
}

// Opcode pieces (linux/bpf_common.h).
const LD: u16 = 0x00;
const LDX: u16 = 0x01;
const ST: u16 = 0x02;
const STX: u16 = 0x03;
const ALU: u16 = 0x04;
const JMP: u16 = 0x05;
const RET: u16 = 0x06;
const MISC: u16 = 0x07;
const W: u16 = 0x00;
const IMM: u16 = 0x00;
const ABS: u16 = 0x20;
const MEM: u16 = 0x60;
const LEN: u16 = 0x80;
const K: u16 = 0x00;
const X: u16 = 0x08;
const A: u16 = 0x10;
const ADD: u16 = 0x00;
const SUB: u16 = 0x10;
const MUL: u16 = 0x20;
const DIV: u16 = 0x30;
const OR: u16 = 0x40;
const AND: u16 = 0x50;
const LSH: u16 = 0x60;
const RSH: u16 = 0x70;
const NEG: u16 = 0x80;
const MOD: u16 = 0x90;
const XOR: u16 = 0xa0;
const JA: u16 = 0x00;
const JEQ: u16 = 0x10;
const JGT: u16 = 0x20;
const JGE: u16 = 0x30;
const JSET: u16 = 0x40;
const TAX: u16 = 0x00;
const TXA: u16 = 0x80;
const SCRATCH: u32 = 16;

/// True for the opcodes `seccomp_check_filter` lets through.
fn allowed_opcode(code: u16) -> bool {
    let alu = |op: u16| [K, X].iter().any(|s| code == ALU | op | s);
    let jmp = |op: u16| [K, X].iter().any(|s| code == JMP | op | s);
    code == LD | W | ABS
        || code == LD | W | LEN
        || code == LDX | W | LEN
        || code == LD | IMM
        || code == LDX | IMM
        || code == LD | MEM
        || code == LDX | MEM
        || code == ST
        || code == STX
        || code == RET | K
        || code == RET | A
        || code == MISC | TAX
        || code == MISC | TXA
        || code == ALU | NEG
        || [ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, MOD, XOR].into_iter().any(alu)
        || code == JMP | JA
        || [JEQ, JGT, JGE, JSET].into_iter().any(jmp)
}

/// A checked seccomp filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    insns: Vec<Insn>,
}

impl Filter {
    /// Reads a program from its bytes (`struct sock_filter` array, this machine's byte
    /// order) and checks it as the kernel would.
    pub fn parse(bytes: &[u8]) -> Result<Filter, FilterError> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(INSN_LEN) || bytes.len() / INSN_LEN > MAX_INSNS {
            return Err(FilterError::Length(bytes.len()));
        }
        let insns = bytes
            .chunks_exact(INSN_LEN)
            .map(|c| Insn {
                code: u16::from_ne_bytes([c[0], c[1]]),
                jt: c[2],
                jf: c[3],
                k: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect();
        Filter::new(insns)
    }

    /// Checks a program given as instructions.
    pub fn new(insns: Vec<Insn>) -> Result<Filter, FilterError> {
        let n = insns.len();
        if n == 0 || n > MAX_INSNS {
            return Err(FilterError::Length(n * INSN_LEN));
        }
        for (i, ins) in insns.iter().enumerate() {
            let c = ins.code;
            if !allowed_opcode(c) {
                return Err(FilterError::Opcode(i, c));
            }
            if c == LD | W | ABS && (ins.k >= DATA_LEN || ins.k % 4 != 0) {
                return Err(FilterError::Load(i));
            }
            let scratch = matches!(c & 0x07, LD | LDX) && c & 0xe0 == MEM || c == ST || c == STX;
            if scratch && ins.k >= SCRATCH {
                return Err(FilterError::Scratch(i));
            }
            if (c == ALU | DIV | K || c == ALU | MOD | K) && ins.k == 0 {
                return Err(FilterError::DivZero(i));
            }
            if c & 0x07 == JMP {
                let rest = (n - i - 1) as u64;
                let bad = if c == JMP | JA {
                    ins.k as u64 >= rest
                } else {
                    ins.jt as u64 >= rest || ins.jf as u64 >= rest
                };
                if bad {
                    return Err(FilterError::Jump(i));
                }
            }
        }
        if insns[n - 1].code & 0x07 != RET {
            return Err(FilterError::NoReturn);
        }
        Ok(Filter { insns })
    }

    /// The instructions.
    pub fn insns(&self) -> &[Insn] {
        &self.insns
    }

    /// The program's bytes, as [`Filter::parse`] reads them.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.insns.len() * INSN_LEN);
        for i in &self.insns {
            out.extend_from_slice(&i.code.to_ne_bytes());
            out.push(i.jt);
            out.push(i.jf);
            out.extend_from_slice(&i.k.to_ne_bytes());
        }
        out
    }

    /// Runs the program over `d`; returns its 32-bit answer. Every checked program ends:
    /// jumps only go forward.
    pub fn run(&self, d: &SeccompData) -> u32 {
        let (mut a, mut x) = (0u32, 0u32);
        let mut mem = [0u32; SCRATCH as usize];
        let mut pc = 0usize;
        while let Some(ins) = self.insns.get(pc) {
            let k = ins.k;
            pc += 1;
            match ins.code {
                c if c == LD | W | ABS => a = d.word(k),
                c if c == LD | W | LEN => a = DATA_LEN,
                c if c == LDX | W | LEN => x = DATA_LEN,
                c if c == LD | IMM => a = k,
                c if c == LDX | IMM => x = k,
                c if c == LD | MEM => a = mem[k as usize],
                c if c == LDX | MEM => x = mem[k as usize],
                c if c == ST => mem[k as usize] = a,
                c if c == STX => mem[k as usize] = x,
                c if c == RET | K => return k,
                c if c == RET | A => return a,
                c if c == MISC | TAX => x = a,
                c if c == MISC | TXA => a = x,
                c if c == ALU | NEG => a = a.wrapping_neg(),
                c if c & 0x07 == ALU => {
                    let v = if c & X != 0 { x } else { k };
                    a = match c & 0xf0 {
                        ADD => a.wrapping_add(v),
                        SUB => a.wrapping_sub(v),
                        MUL => a.wrapping_mul(v),
                        // The kernel's classic BPF: division by a zero X ends the program
                        // with 0.
                        DIV if v == 0 => return 0,
                        DIV => a / v,
                        MOD if v == 0 => return 0,
                        MOD => a % v,
                        OR => a | v,
                        AND => a & v,
                        LSH => a.checked_shl(v).unwrap_or(0),
                        RSH => a.checked_shr(v).unwrap_or(0),
                        _ => a ^ v,
                    };
                }
                c if c == JMP | JA => pc += k as usize,
                c => {
                    let v = if c & X != 0 { x } else { k };
                    let hit = match c & 0xf0 {
                        JEQ => a == v,
                        JGT => a > v,
                        JGE => a >= v,
                        _ => a & v != 0,
                    };
                    pc += if hit { ins.jt } else { ins.jf } as usize;
                }
            }
        }
        // Unreachable for a checked program (it ends with a return); the kernel's answer
        // for running off the end would be a kill.
        ret::KILL_PROCESS
    }
}

/// The strict mode (`SECCOMP_MODE_STRICT`): only `read`, `write`, `exit` and `sigreturn`.
pub fn strict_allows(nr: i64) -> bool {
    if cfg!(target_arch = "aarch64") {
        matches!(nr, 63 | 64 | 93 | 139)
    } else {
        matches!(nr, 0 | 1 | 60 | 15)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stmt(code: u16, k: u32) -> Insn {
        Insn { code, jt: 0, jf: 0, k }
    }
    fn jump(code: u16, k: u32, jt: u8, jf: u8) -> Insn {
        Insn { code, jt, jf, k }
    }

    /// An OpenSSH-style allow list: arch check, then `nr == n ? ALLOW : next`, default kill.
    fn allow_list(nrs: &[u32], default: u32) -> Filter {
        let mut p = vec![
            stmt(LD | W | ABS, 4),
            jump(JMP | JEQ | K, native_arch(), 1, 0),
            stmt(RET | K, ret::KILL_PROCESS),
            stmt(LD | W | ABS, 0),
        ];
        for &n in nrs {
            p.push(jump(JMP | JEQ | K, n, 0, 1));
            p.push(stmt(RET | K, ret::ALLOW));
        }
        p.push(stmt(RET | K, default));
        Filter::new(p).unwrap()
    }

    #[test]
    fn allow_list_allows_only_its_calls() {
        let f = allow_list(&[0, 1, 20], ret::KILL_THREAD);
        for (nr, v) in [(0, Verdict::Allow), (1, Verdict::Allow), (20, Verdict::Allow), (44, Verdict::Deny)] {
            assert_eq!(Verdict::of(f.run(&SeccompData::native(nr, [0; 6]))), v, "nr {nr}");
        }
        // Another architecture's calls are killed.
        let other = SeccompData { nr: 1, arch: 0x4000_0003, ..Default::default() };
        assert_eq!(Verdict::of(f.run(&other)), Verdict::Deny);
    }

    #[test]
    fn errno_default_and_argument_checks() {
        // sendto allowed only with flags (args[3]) == MSG_DONTWAIT|MSG_NOSIGNAL; else EPERM.
        let p = vec![
            stmt(LD | W | ABS, 0),
            jump(JMP | JEQ | K, 44, 0, 3),
            stmt(LD | W | ABS, 16 + 3 * 8),
            jump(JMP | JEQ | K, 0x4040, 0, 1),
            stmt(RET | K, ret::ALLOW),
            stmt(RET | K, ret::ERRNO | 1),
        ];
        let f = Filter::new(p).unwrap();
        let mut d = SeccompData::native(44, [3, 0, 24, 0x4040, 0, 0]);
        assert_eq!(Verdict::of(f.run(&d)), Verdict::Allow);
        d.args[3] = 0x4000;
        assert_eq!(Verdict::of(f.run(&d)), Verdict::Errno(1));
        d.args[3] = 0x4040 | (1 << 32);
        // Only the low word is looked at by this program.
        assert_eq!(Verdict::of(f.run(&d)), Verdict::Allow);
    }

    #[test]
    fn alu_scratch_and_x() {
        let p = vec![
            stmt(LD | IMM, 6),
            stmt(ST, 3),
            stmt(LDX | IMM, 7),
            stmt(ALU | MUL | X, 0),
            stmt(MISC | TAX, 0),
            stmt(LD | MEM, 3),
            stmt(ALU | ADD | X, 0),
            stmt(ALU | MOD | K, 40),
            jump(JMP | JEQ | K, 8, 0, 1),
            stmt(RET | K, ret::ALLOW),
            stmt(RET | A, 0),
        ];
        let f = Filter::new(p).unwrap();
        // (6 * 7 + 6) % 40 == 8.
        assert_eq!(f.run(&SeccompData::default()), ret::ALLOW);
        assert_eq!(Filter::parse(&f.to_bytes()).unwrap(), f);
    }

    #[test]
    fn division_by_zero_x_returns_zero() {
        let p =
            vec![stmt(LDX | IMM, 0), stmt(LD | IMM, 5), stmt(ALU | DIV | X, 0), stmt(RET | K, ret::ALLOW)];
        assert_eq!(Filter::new(p).unwrap().run(&SeccompData::default()), 0);
    }

    #[test]
    fn rejects_what_the_kernel_rejects() {
        assert_eq!(Filter::parse(&[]), Err(FilterError::Length(0)));
        assert_eq!(Filter::parse(&[0; 7]), Err(FilterError::Length(7)));
        assert!(matches!(
            Filter::new(vec![stmt(LD | W | ABS, 64), stmt(RET | K, 0)]),
            Err(FilterError::Load(0))
        ));
        assert!(matches!(
            Filter::new(vec![stmt(LD | W | ABS, 2), stmt(RET | K, 0)]),
            Err(FilterError::Load(0))
        ));
        assert!(matches!(
            Filter::new(vec![jump(JMP | JEQ | K, 0, 1, 0), stmt(RET | K, 0)]),
            Err(FilterError::Jump(0))
        ));
        assert!(matches!(Filter::new(vec![stmt(JMP | JA, 1), stmt(RET | K, 0)]), Err(FilterError::Jump(0))));
        assert!(matches!(Filter::new(vec![stmt(LD | IMM, 0)]), Err(FilterError::NoReturn)));
        assert!(matches!(Filter::new(vec![stmt(ST, 16), stmt(RET | K, 0)]), Err(FilterError::Scratch(0))));
        assert!(matches!(
            Filter::new(vec![stmt(ALU | DIV | K, 0), stmt(RET | K, 0)]),
            Err(FilterError::DivZero(0))
        ));
        // BPF_LD|BPF_B|BPF_ABS (byte loads) are not seccomp's.
        assert!(matches!(
            Filter::new(vec![stmt(0x30, 0), stmt(RET | K, 0)]),
            Err(FilterError::Opcode(0, 0x30))
        ));
    }

    #[test]
    fn stacked_filters_take_the_strongest() {
        let a = ret::ALLOW;
        let e = ret::ERRNO | 13;
        let k = ret::KILL_PROCESS;
        assert_eq!(Verdict::combine([a, e]), Some(e));
        assert_eq!(Verdict::combine([e, k, a]), Some(k));
        assert_eq!(Verdict::combine([a, ret::LOG]).map(Verdict::of), Some(Verdict::Allow));
        assert_eq!(Verdict::of(ret::TRAP), Verdict::Deny);
        assert_eq!(Verdict::of(ret::USER_NOTIF), Verdict::Deny);
    }
}
