//! How the tc conntrack's two entries of a flow find each other, and when a reply entry's flow
//! is over: the tc programs decide it when a new flow wants a reply entry's key, the agent's
//! garbage collection when it walks the maps, and both must call the same entries dead.

use crate::{CtKey, CtValue, ct_flags, ct_timeout};

/// Writes into `key` the key of the entry for the other direction of `value`'s flow: a forward
/// entry's reply key, or a reply entry's forward key. Field by field into the caller's key:
/// the tc programs build it in their scratch slot, off the verifier's small stack.
#[inline(always)]
pub fn write_reverse_key(key: &mut CtKey, value: &CtValue, proto: u8, family: u8) {
    key.src = value.dst;
    key.dst = value.src;
    key.sport = value.dport;
    key.dport = value.sport;
    key.proto = proto;
    key.family = family;
    key._pad = 0;
}

/// [`write_reverse_key`] into a new key, for `key`'s entry `value`.
#[inline(always)]
pub fn reverse_key(key: &CtKey, value: &CtValue) -> CtKey {
    let mut reverse = CtKey::default();
    write_reverse_key(&mut reverse, value, key.proto, key.family);
    reverse
}

/// Whether forward entry `forward` is the flow the reply entry under `reply_key` belongs to:
/// it rewrites to the reverse of that key. A forward entry of the same client tuple that
/// rewrites elsewhere belongs to a newer flow.
#[inline(always)]
pub fn answers(forward: &CtValue, reply_key: &CtKey) -> bool {
    forward.flags & ct_flags::REPLY == 0
        && forward.src == reply_key.dst
        && forward.sport == reply_key.dport
        && forward.dst == reply_key.src
        && forward.dport == reply_key.sport
}

/// Whether forward entry `forward` keeps the reply entry under `reply_key` alive at `now`: it
/// is that entry's flow and has not idled past its timeout.
#[inline(always)]
pub fn holds_reply(forward: &CtValue, reply_key: &CtKey, now: u64) -> bool {
    answers(forward, reply_key)
        && !ct_timeout::expired(reply_key.proto, forward.flags, forward.last_seen_ns, now)
}

/// Whether a reply entry without a live forward entry has idled long enough to be an orphan:
/// until then its flow may be alive with its forward entry evicted (the next reply rebuilds
/// it), or the forward entry may be being written just after it.
#[inline(always)]
pub fn orphaned(reply: &CtValue, now: u64) -> bool {
    now.saturating_sub(reply.last_seen_ns) > ct_timeout::ORPHAN_REPLY_NS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{family, proto};

    fn flow() -> (CtKey, CtValue) {
        let forward_key = CtKey {
            src: [1, 0, 0, 0],
            dst: [2, 0, 0, 0],
            sport: 1000,
            dport: 80,
            proto: proto::UDP,
            family: family::V4,
            _pad: 0,
        };
        let forward = CtValue {
            src: [9, 0, 0, 0],
            dst: [3, 0, 0, 0],
            sport: 2000,
            dport: 8080,
            last_seen_ns: 100,
            ..CtValue::default()
        };
        (forward_key, forward)
    }

    #[test]
    fn a_forward_entry_answers_the_reverse_of_its_rewrite() {
        let (forward_key, forward) = flow();
        let reply_key = reverse_key(&forward_key, &forward);
        assert_eq!(
            (
                reply_key.src,
                reply_key.sport,
                reply_key.dst,
                reply_key.dport
            ),
            ([3, 0, 0, 0], 8080, [9, 0, 0, 0], 2000)
        );
        assert!(answers(&forward, &reply_key));
        assert!(holds_reply(&forward, &reply_key, 100));
        let later = 100 + ct_timeout::UDP_NS + 1;
        assert!(!holds_reply(&forward, &reply_key, later));
        // A newer flow of the client tuple took another SNAT port.
        let newer = CtValue {
            sport: 2001,
            ..forward
        };
        assert!(!answers(&newer, &reply_key));
        // A reply entry never answers.
        let reply = CtValue {
            flags: ct_flags::REPLY,
            ..forward
        };
        assert!(!answers(&reply, &reply_key));
        assert!(!orphaned(&forward, 100 + ct_timeout::ORPHAN_REPLY_NS));
        assert!(orphaned(&forward, 101 + ct_timeout::ORPHAN_REPLY_NS));
    }
}
