//! Incremental CRC32c (Castagnoli) updates for SCTP port rewrites, as pure `no_std` functions:
//! the tc programs call them, the host unit tests below check them against a from-scratch CRC.
//!
//! SCTP's checksum (RFC 9260 §6.8, appendix A) is the CRC32c of the whole SCTP packet with the
//! checksum field zeroed; unlike TCP/UDP it has no pseudo-header, so rewriting IP addresses
//! leaves it alone, and only the port rewrites (the first four bytes) change it. A CRC is affine
//! over GF(2): for two messages of equal length, `crc(new) = crc(old) ^ crc0(new ^ old)`, where
//! `crc0` is the raw CRC (zero initial value, no final inversion); the initial value and the
//! final inversion cancel because both messages have the same length. `new ^ old` is four delta
//! bytes followed by zeros, and running zero bytes through a raw CRC multiplies it by `x^8` each,
//! so `crc0` is the delta word times `x^(8·len)` modulo the polynomial: two multiplications by
//! precomputed powers (`x^(8·lo)` and `x^(8·256·hi)` for `len` = 256·hi + lo), whatever the
//! packet size (zlib's `crc32_combine` and Linux's `crc32c_shift` build the same power bit by
//! bit). Constant work, no loop over the payload, no packet
//! bytes beyond the header touched.
//!
//! Representation: reflected, as SCTP's CRC is computed, so bit 31 of a `u32` is the
//! coefficient of `x^0` and bit 0 that of `x^31`.

/// The CRC32c polynomial, reflected (without the `x^32` term).
pub const POLY: u32 = 0x82f6_3b78;

/// `x^0` in the reflected representation.
const ONE: u32 = 1 << 31;

/// `a · b mod POLY` over GF(2), branch-free so the verifier walks one path per step.
#[inline(always)]
pub const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut i = 0;
    while i < 32 {
        // Coefficient of x^i in `a` selects `b · x^i`.
        product ^= b & 0u32.wrapping_sub((a >> (31 - i)) & 1);
        // b · x: a shift, reduced by the polynomial when x^31 overflows into x^32.
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        i += 1;
    }
    product
}

/// `x^(8·j) mod POLY` for j = 0..256: `j` zero bytes.
pub const ZERO_BYTES: [u32; 256] = powers(ONE >> 8);

/// `x^(8·256·j) mod POLY` for j = 0..256: `256·j` zero bytes (`x^2048` is 256 zero bytes).
pub const ZERO_BYTES_BY_256: [u32; 256] = powers(multiply(ZERO_BYTES[255], ONE >> 8));

/// `base^j` for j = 0..256.
const fn powers(base: u32) -> [u32; 256] {
    let mut table = [0u32; 256];
    table[0] = ONE;
    let mut j = 1;
    while j < 256 {
        table[j] = multiply(table[j - 1], base);
        j += 1;
    }
    table
}

/// Advances a raw CRC state through `len` zero bytes: `crc · x^(8·len) mod POLY`, as two
/// products by table entries (`len` = 256·hi + lo). Two branch-free multiplications: the
/// verifier walks them once per path that reaches them. With one conditional product per bit
/// of `len` (sixteen, each taken or not) it walked about 260 000 instructions of each tc family
/// program, most of its load time.
#[inline(always)]
pub fn shift(crc: u32, len: u16) -> u32 {
    let low = ZERO_BYTES[usize::from(len & 0xff)];
    let high = ZERO_BYTES_BY_256[usize::from(len >> 8)];
    multiply(multiply(crc, low), high)
}

/// What to XOR into an SCTP packet's CRC32c when its first four bytes (source and destination
/// port) change from `old` to `new` and the packet is `len` bytes long (common header
/// included). The words are the header's first four bytes and the checksum field read as
/// little-endian `u32`s (`u32::from_le_bytes`; SCTP stores the CRC so, RFC 9260 appendix A).
///
/// The update is exact whether or not the old CRC was valid: an invalid checksum stays invalid
/// by the same error, so the receiver still drops what it would have dropped untranslated.
#[inline(always)]
pub fn port_rewrite_delta(old: u32, new: u32, len: u16) -> u32 {
    // Four delta bytes fed into a zero CRC: XOR of the little-endian word, then 32 bit steps,
    // i.e. · x^32; the remaining len - 4 zero bytes add · x^(8·(len - 4)): x^(8·len) in all.
    shift(old ^ new, len)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// Bitwise CRC32c from the definition, independent of the code under test.
    fn crc32c(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for b in bytes {
            crc ^= u32::from(*b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ POLY
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// SCTP's checksum of `packet`: CRC32c with the field (bytes 8..12) as zero.
    fn sctp_crc(packet: &[u8]) -> u32 {
        let mut copy = packet.to_vec();
        copy[8..12].fill(0);
        crc32c(&copy)
    }

    /// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect()
    }

    fn word(bytes: &[u8]) -> u32 {
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }

    #[test]
    fn reference_matches_rfc_vectors() {
        // RFC 3720 B.4 test vectors (iSCSI uses the same CRC32c).
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46dd_794e);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn shift_equals_feeding_zero_bytes() {
        for (seed, len) in [(1u64, 0u16), (2, 1), (3, 7), (4, 64), (5, 1499), (6, 65535)] {
            let start = word(&bytes(seed, 4));
            let mut fed = start;
            for _ in 0..len {
                for _ in 0..8 {
                    fed = if fed & 1 != 0 {
                        (fed >> 1) ^ POLY
                    } else {
                        fed >> 1
                    };
                }
            }
            assert_eq!(shift(start, len), fed, "len {len}");
        }
    }

    #[test]
    fn the_tables_hold_the_powers_of_zero_bytes() {
        let mut power = ONE;
        for (j, entry) in ZERO_BYTES.iter().enumerate() {
            assert_eq!(*entry, power, "x^(8·{j})");
            power = multiply(power, ONE >> 8);
        }
        let by_256 = power;
        let mut power = ONE;
        for (j, entry) in ZERO_BYTES_BY_256.iter().enumerate() {
            assert_eq!(*entry, power, "x^(8·256·{j})");
            power = multiply(power, by_256);
        }
    }

    #[test]
    fn multiply_is_a_ring_product() {
        let (a, b, c) = (0x1234_5678, 0x9abc_def0, 0x0f0f_f0f0);
        assert_eq!(multiply(a, ONE), a);
        assert_eq!(multiply(a, b), multiply(b, a));
        assert_eq!(multiply(multiply(a, b), c), multiply(a, multiply(b, c)));
        assert_eq!(multiply(a, b ^ c), multiply(a, b) ^ multiply(a, c));
        assert_eq!(shift(shift(a, 300), 1200), shift(a, 1500));
    }

    #[test]
    fn port_rewrite_matches_recomputation() {
        let mut checked = 0;
        for len in [12usize, 16, 32, 52, 60, 61, 255, 1452, 9000, 65_515] {
            for seed in 1..=8u64 {
                let mut packet = bytes(seed * 7919 + len as u64, len);
                let crc = sctp_crc(&packet);
                packet[8..12].copy_from_slice(&crc.to_le_bytes());
                let old = word(&packet[0..4]);
                let ports = bytes(seed, 4);
                packet[0..4].copy_from_slice(&ports);
                let delta = port_rewrite_delta(old, word(&ports), len as u16);
                let updated = word(&packet[8..12]) ^ delta;
                assert_eq!(updated, sctp_crc(&packet), "len {len} seed {seed}");
                checked += 1;
            }
        }
        std::eprintln!("port rewrite: {checked} packets, CRC32c delta == recomputation");
    }

    #[test]
    fn an_invalid_crc_stays_invalid_by_the_same_error() {
        let mut packet = bytes(42, 100);
        let good = sctp_crc(&packet);
        let error = 0x0000_0100;
        packet[8..12].copy_from_slice(&(good ^ error).to_le_bytes());
        let old = word(&packet[0..4]);
        packet[0..4].copy_from_slice(&[0x1f, 0x90, 0x75, 0x30]);
        let updated = word(&packet[8..12]) ^ port_rewrite_delta(old, word(&packet[0..4]), 100);
        assert_eq!(updated ^ sctp_crc(&packet), error);
    }
}
