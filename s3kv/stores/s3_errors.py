"""How the S3 stores' errors become :mod:`s3kv.errors` names: botocore's and
aiohttp's in :func:`map_error`, here and nowhere else, and the S3 error codes
each kind is told by (:mod:`s3kv.stores.native` maps its client's errors by
the same codes).
"""

from __future__ import annotations

import asyncio

import aiohttp
import aiohttp.http_exceptions
import botocore.exceptions as bexc

from s3kv.errors import (
    AlreadyExists,
    ConfigError,
    NotFound,
    PermissionDenied,
    Precondition,
    RangeNotSatisfiable,
    S3KVError,
    Throttled,
    Transient,
)

NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound", "NoSuchUpload"}
DENIED_CODES = {"AccessDenied", "403", "Forbidden"}
"""Refused for this object (a bucket policy, a KMS key for its prefix):
other objects may well be readable."""
CREDENTIALS_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "InvalidSecurity",
    "RequestExpired",
    "RequestTimeTooSkewed",
    "AuthorizationHeaderMalformed",
    "AccountProblem",
    "NotSignedUp",
    "AllAccessDisabled",
}
"""Refused for the caller itself, whatever the object (S3's and STS's codes
for keys unknown or expired, signatures or tokens rejected, a clock too far
off to sign, an account or bucket closed to it): every request fails alike."""
EXISTS_CODES = {"PreconditionFailed", "412"}
NO_CREDENTIALS = (
    "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE, or run with an instance or pod role"
)
THROTTLED_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "503",
}


def error_code(e: bexc.ClientError) -> tuple[str, int]:
    err = e.response.get("Error", {})
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(err.get("Code", status)), int(status or 0)


def map_error(e: BaseException, what: str, *, if_match: bool = False) -> Exception:
    """The one place where botocore/aiohttp errors become s3kv errors."""
    if isinstance(e, bexc.ClientError):
        code, status = error_code(e)
        if code == "NoSuchBucket":
            return NotFound(what, "no such bucket")
        if code in NOT_FOUND_CODES or status == 404:
            return NotFound(what)
        if code in EXISTS_CODES or status == 412:
            return Precondition(what) if if_match else AlreadyExists(what)
        if code in CREDENTIALS_CODES:
            return PermissionDenied(f"{what}: {code} (HTTP {status})", credentials=True)
        if code in DENIED_CODES or status == 403:
            return PermissionDenied(f"{what}: {code}")
        if code == "InvalidRange" or status == 416:
            return RangeNotSatisfiable(f"{what}: range not satisfiable")
        if code in THROTTLED_CODES or status in (429, 503):
            return Throttled(f"{what}: {code} (HTTP {status})")
        return Transient(f"{what}: {code} (HTTP {status})")
    if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
        return ConfigError(f"no usable AWS credentials: {e}")
    if isinstance(e, (bexc.CredentialRetrievalError, bexc.TokenRetrievalError, bexc.SSOError)):
        # Credentials that expired and could not be renewed (an instance
        # role's endpoint, an SSO session): no request can be signed.
        return PermissionDenied(f"{what}: {type(e).__name__}: {e}", credentials=True)
    if isinstance(
        e,
        (
            bexc.EndpointConnectionError,
            bexc.ConnectionError,
            bexc.HTTPClientError,
            # The connection dropped in the middle of a body: botocore finds
            # fewer bytes than Content-Length said, or aiohttp the payload cut.
            bexc.IncompleteReadError,
            aiohttp.ClientError,
            aiohttp.http_exceptions.HttpProcessingError,
            asyncio.TimeoutError,
            ConnectionError,
        ),
    ):
        return Transient(f"{what}: {type(e).__name__}: {e}")
    if isinstance(e, bexc.BotoCoreError):
        return S3KVError(f"{what}: {e}")
    return e if isinstance(e, Exception) else S3KVError(str(e))
