//! Custody of snapshot keys (issue 26): the service's key-encryption key, and each snapshot's
//! data key wrapped under it.
//!
//! The key-encryption key is derived from `keys.secret` ([`crate::keys::derive_key`], the
//! derivation the signing-key seeds use, with a label of its own: an independent key), not set
//! by a setting of its own: every gateway replica already holds that secret, a node holds none
//! (the hardening issue: a node needs no `keys.secret`), and an operator has one secret to keep,
//! not two that must change together. A copy of the database alone therefore opens no snapshot.
//!
//! Wrapped form: `version (1) ‖ nonce (24) ‖ ciphertext+tag (48)`, XChaCha20-Poly1305 with the
//! snapshot's binding (tenant, sandbox and snapshot id) as associated data: a wrapped key moved
//! to another row, tenant or snapshot does not unwrap.

use std::sync::Arc;

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use sandgate_sandbox::{DataKey, SnapshotAad};
use zeroize::Zeroize as _;

const WRAPPED_V1: u8 = 1;
const NONCE_BYTES: usize = 24;
/// The label of the key-encryption key's derivation.
const KEK_PURPOSE: &str = "snapshot data keys v1";
/// The label of a wrapped key's associated data.
const WRAP_PURPOSE: &str = "sandgate snapshot data key v1";

/// A snapshot's data key does not unwrap.
#[derive(Debug, thiserror::Error)]
#[error(
    "the data key of snapshot {snapshot_id} does not unwrap with keys.secret: the row was \
     altered or moved to another tenant, sandbox or snapshot, or keys.secret changed since it was \
     taken (set it back to the value it had then; every replica needs the same value)"
)]
pub struct UnwrapError {
    /// The snapshot.
    pub snapshot_id: String,
}

/// The service's key-encryption key: issues, wraps and unwraps snapshots' data keys. Cheap to
/// clone; never printed.
#[derive(Clone)]
pub struct SnapshotKeys {
    kek: Arc<XChaCha20Poly1305>,
}

impl std::fmt::Debug for SnapshotKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotKeys").finish_non_exhaustive()
    }
}

impl SnapshotKeys {
    /// The keys whose key-encryption key is derived from the deployment's secret.
    pub fn new(secret: &[u8]) -> Self {
        let mut kek = crate::keys::derive_key(secret, KEK_PURPOSE);
        let cipher = XChaCha20Poly1305::new(&kek.into());
        kek.zeroize();
        Self {
            kek: Arc::new(cipher),
        }
    }

    /// The keys of `config` (its `keys.secret`).
    pub fn of(config: &crate::Config) -> Self {
        Self::new(config.keys.secret_bytes())
    }

    /// A fresh data key for the snapshot `aad` names, and its wrapped form for the row.
    pub fn issue(&self, aad: &SnapshotAad) -> (DataKey, Vec<u8>) {
        let key = DataKey::generate();
        let wrapped = self.wrap(&key, aad);
        (key, wrapped)
    }

    /// `key` wrapped for the snapshot `aad` names.
    pub fn wrap(&self, key: &DataKey, aad: &SnapshotAad) -> Vec<u8> {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let binding = aad.bytes(WRAP_PURPOSE);
        let sealed = self
            .kek
            .encrypt(
                &nonce,
                Payload {
                    msg: key.expose(),
                    aad: &binding,
                },
            )
            .expect("sealing 32 bytes cannot fail");
        let mut out = Vec::with_capacity(1 + NONCE_BYTES + sealed.len());
        out.push(WRAPPED_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// The data key of the snapshot `aad` names, from its row's `wrapped` form.
    pub fn unwrap(&self, aad: &SnapshotAad, wrapped: &[u8]) -> Result<DataKey, UnwrapError> {
        let refused = || UnwrapError {
            snapshot_id: aad.snapshot_id.clone(),
        };
        let (&version, rest) = wrapped.split_first().ok_or_else(refused)?;
        if version != WRAPPED_V1 || rest.len() < NONCE_BYTES {
            return Err(refused());
        }
        let (nonce, ciphertext) = rest.split_at(NONCE_BYTES);
        let nonce = XNonce::from(<[u8; NONCE_BYTES]>::try_from(nonce).map_err(|_| refused())?);
        let binding = aad.bytes(WRAP_PURPOSE);
        let mut plain = self
            .kek
            .decrypt(
                &nonce,
                Payload {
                    msg: ciphertext,
                    aad: &binding,
                },
            )
            .map_err(|_| refused())?;
        let key = DataKey::from_slice(&plain);
        plain.zeroize();
        key.ok_or_else(refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aad(tenant: &str, sandbox: &str, snapshot: &str) -> SnapshotAad {
        SnapshotAad {
            tenant_id: tenant.into(),
            sandbox_id: sandbox.into(),
            snapshot_id: snapshot.into(),
        }
    }

    #[test]
    fn a_wrapped_key_unwraps_only_for_its_own_snapshot_under_its_own_secret() {
        let keys = SnapshotKeys::new(b"a deployment secret of at least 32 characters");
        let binding = aad("t1", "sbx_1", "snap_1");
        let (key, wrapped) = keys.issue(&binding);
        assert_eq!(wrapped.len(), 1 + 24 + 32 + 16);
        assert!(
            !wrapped.windows(32).any(|w| w == key.expose()),
            "the wrapped form does not hold the key"
        );
        let back = keys.unwrap(&binding, &wrapped).expect("it unwraps");
        assert_eq!(back.expose(), key.expose());
        for other in [
            aad("t2", "sbx_1", "snap_1"),
            aad("t1", "sbx_2", "snap_1"),
            aad("t1", "sbx_1", "snap_2"),
        ] {
            assert!(keys.unwrap(&other, &wrapped).is_err(), "{other:?}");
        }
        let other_secret = SnapshotKeys::new(b"another deployment secret, also 32 characters");
        assert!(other_secret.unwrap(&binding, &wrapped).is_err());
        let mut altered = wrapped.clone();
        altered[30] ^= 1;
        assert!(keys.unwrap(&binding, &altered).is_err());
        assert!(keys.unwrap(&binding, &wrapped[..40]).is_err());
        assert!(keys.unwrap(&binding, &[]).is_err());
        let (again, _) = keys.issue(&binding);
        assert_ne!(
            again.expose(),
            key.expose(),
            "a fresh data key per snapshot"
        );
    }

    #[test]
    fn the_kek_is_not_the_signing_seeds_key() {
        let secret = b"a deployment secret of at least 32 characters";
        assert_ne!(
            crate::keys::derive_key(secret, KEK_PURPOSE),
            crate::keys::derive_key(secret, "signing-key seeds")
        );
    }
}
