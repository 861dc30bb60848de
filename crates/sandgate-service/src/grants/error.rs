//! What a grant rule refuses, or what failed on our side. The texts are the
//! `error_description`s the token endpoint sends (RFC 6749 §5.2).

use sandgate_auth::Scope;
use sandgate_auth::pkce::PkceError;
use sandgate_auth::scope::UnknownScope;
use sandgate_store::StoreError;

/// Why a grant operation gave nothing.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// No such authorization code.
    #[error("the authorization code is invalid")]
    CodeInvalid,
    /// The code was redeemed before: what it issued is now revoked.
    #[error("the authorization code was already used; the tokens issued with it are revoked")]
    CodeReplayed,
    /// The code's time is up.
    #[error("the authorization code has expired")]
    CodeExpired,
    /// The code belongs to another client.
    #[error("the authorization code was issued to another client")]
    CodeOtherClient,
    /// The redirect URI is not the authorization request's.
    #[error("redirect_uri does not match the authorization request")]
    RedirectUriMismatch,
    /// The PKCE verifier does not match the challenge.
    #[error(transparent)]
    Pkce(PkceError),
    /// A resource other than the one the grant was issued for (RFC 8707).
    #[error("resource {given:?} is not the one this grant was issued for ({bound})")]
    ResourceMismatch {
        /// The resource asked for.
        given: String,
        /// The grant's resource.
        bound: String,
    },
    /// The app connection was revoked (disconnected).
    #[error("the app was disconnected")]
    Disconnected,
    /// No such refresh token.
    #[error("the refresh token is invalid")]
    RefreshInvalid,
    /// The refresh token belongs to another client.
    #[error("the refresh token was issued to another client")]
    RefreshOtherClient,
    /// The refresh token was revoked.
    #[error("the refresh token was revoked")]
    RefreshRevoked,
    /// The refresh token was used before: its whole family is now revoked.
    #[error("the refresh token was already used; every refresh token of this sign-in is revoked")]
    RefreshReused,
    /// The refresh token's time is up.
    #[error("the refresh token has expired")]
    RefreshExpired,
    /// The scope asked for is not one we know.
    #[error(transparent)]
    ScopeUnknown(UnknownScope),
    /// The refresh token does not hold a scope asked for.
    #[error("the refresh token does not hold the {0} scope")]
    ScopeNotHeld(Scope),
    /// The client may not have a scope asked for.
    #[error("this client may not have the {0} scope")]
    ScopeNotAllowed(Scope),
    /// Only admin-created confidential clients may use client credentials.
    #[error("only clients created with `sandgate admin client create` may use client_credentials")]
    NotAdminClient,
    /// The client's own grant was revoked.
    #[error("this client's access was revoked")]
    ClientRevoked,
    /// A public client presented a secret.
    #[error("this client is public: it has no secret to present")]
    PublicClientSecret,
    /// A confidential client presented no secret.
    #[error("this client must authenticate with its client secret")]
    SecretRequired,
    /// The secret, or the way it was presented, is wrong.
    #[error("client authentication failed")]
    ClientAuthFailed,
    /// Postgres failed.
    #[error("database error")]
    Store(#[from] StoreError),
    /// Signing an access token failed.
    #[error("signing failed")]
    Sign(#[from] sandgate_auth::TokenError),
}
