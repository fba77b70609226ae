//! [`Access`]: what peers may do with a registration.
//!
//! An owner chooses it when it registers; a descriptor carries it, and an
//! owner refuses an operation its registration does not allow with
//! [`RdmaError::AccessDenied`](crate::RdmaError::AccessDenied). Every
//! registration made without naming one is [`Access::Read`], so memory
//! becomes remotely writable only when its owner asked for that.

use std::fmt;

/// What peers may do with a registration: read it, write it, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Access {
    /// Peers may read it (GET); the default.
    #[default]
    Read,
    /// Peers may write it (PUT) and not read it.
    Write,
    /// Peers may read and write it.
    ReadWrite,
}

impl Access {
    /// Whether a peer may read a registration with this access.
    pub fn allows_read(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }

    /// Whether a peer may write a registration with this access.
    pub fn allows_write(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }

    /// Whether everything `other` allows, this allows too.
    pub fn covers(self, other: Access) -> bool {
        (self.allows_read() || !other.allows_read())
            && (self.allows_write() || !other.allows_write())
    }

    /// The byte this access is carried as on the wire: bit 0 read, bit 1
    /// write.
    pub fn to_bits(self) -> u8 {
        u8::from(self.allows_read()) | (u8::from(self.allows_write()) << 1)
    }

    /// The access a wire byte names; `None` for 0 or any other bit set.
    pub fn from_bits(bits: u8) -> Option<Access> {
        match bits {
            1 => Some(Access::Read),
            2 => Some(Access::Write),
            3 => Some(Access::ReadWrite),
            _ => None,
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::ReadWrite => "read-write",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Access; 3] = [Access::Read, Access::Write, Access::ReadWrite];

    #[test]
    fn every_access_round_trips_through_its_bits() {
        for access in ALL {
            assert_eq!(Access::from_bits(access.to_bits()), Some(access));
        }
        for bits in [0u8, 4, 5, 7, 0xff] {
            assert_eq!(Access::from_bits(bits), None, "{bits:#x}");
        }
    }

    #[test]
    fn read_write_covers_both_and_neither_half_covers_the_other() {
        assert!(ALL.iter().all(|&a| Access::ReadWrite.covers(a)));
        assert!(!Access::Read.covers(Access::Write));
        assert!(!Access::Write.covers(Access::Read));
        assert!(!Access::Read.covers(Access::ReadWrite));
        assert!(ALL.iter().all(|&a| a.covers(a)));
    }

    #[test]
    fn registrations_are_read_only_unless_asked() {
        assert_eq!(Access::default(), Access::Read);
        assert!(Access::default().allows_read() && !Access::default().allows_write());
    }
}
