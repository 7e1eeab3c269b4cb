"""The S3 store's errors as s3kv's (:mod:`s3kv.stores.s3_errors`): what each
S3 code, HTTP status and botocore or aiohttp exception becomes."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("SlowDown", 503, "Throttled"),
        ("ThrottlingException", 400, "Throttled"),
        ("InternalError", 500, "Transient"),
        ("NoSuchKey", 404, "NotFound"),
        ("PreconditionFailed", 412, "AlreadyExists"),
    ],
)
def test_s3_errors_map_onto_s3kv_errors(code, status, kind):
    from botocore.exceptions import ClientError

    from s3kv.stores.s3_errors import map_error

    e = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    assert type(map_error(e, "k")).__name__ == kind


def test_a_412_to_an_if_match_request_is_a_precondition_and_a_404_not_found():
    from botocore.exceptions import ClientError

    from s3kv.errors import NotFound, Precondition
    from s3kv.stores.s3_errors import map_error

    def error(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    assert type(map_error(error("PreconditionFailed", 412), "k", if_match=True)) is Precondition
    assert type(map_error(error("NoSuchKey", 404), "k", if_match=True)) is NotFound


@pytest.mark.parametrize(
    ("code", "status", "credentials"),
    [
        ("AccessDenied", 403, False),  # a bucket policy or KMS key for this object's prefix
        ("403", 403, False),  # a HEAD's 403 (no body, no code)
        ("InvalidAccessKeyId", 403, True),
        ("SignatureDoesNotMatch", 403, True),
        ("ExpiredToken", 400, True),
        ("InvalidToken", 400, True),
        ("TokenRefreshRequired", 400, True),
        ("InvalidClientTokenId", 403, True),
        ("RequestTimeTooSkewed", 403, True),
        ("AllAccessDisabled", 403, True),
    ],
)
def test_a_403_says_whether_the_credentials_or_the_object_were_refused(code, status, credentials):
    from botocore.exceptions import ClientError

    from s3kv.errors import PermissionDenied
    from s3kv.stores.s3_errors import map_error

    e = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    mapped = map_error(e, "k")
    assert isinstance(mapped, PermissionDenied) and mapped.credentials is credentials
    assert code in str(mapped)


def test_a_body_cut_short_and_credentials_that_expired_map_onto_s3kv_errors():
    import aiohttp
    import botocore.exceptions as bexc

    from s3kv.errors import PermissionDenied, Transient
    from s3kv.stores.s3_errors import map_error

    for e in (
        bexc.IncompleteReadError(actual_bytes=100, expected_bytes=1000),
        aiohttp.ClientPayloadError("Response payload is not completed"),
        bexc.ResponseStreamingError(error="connection reset"),
    ):
        assert isinstance(map_error(e, "k"), Transient), e
    expired = map_error(bexc.CredentialRetrievalError(provider="iam-role", error_msg="timed out"), "k")
    assert isinstance(expired, PermissionDenied) and expired.credentials
