terraform {
  # No providers: this module only renders JSON, so it can be planned
  # (and tested) without any cloud credentials or provider download.
  required_version = ">= 1.5.7"
}
